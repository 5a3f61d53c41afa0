"""A restore proven while serving whose grace period cannot be written (grace.json: a
full disk, an I/O error) must not leave the server serving as if nothing was proven.

Real server process, real files. The data directory of a live server is copied (`cp
-a`), a worker goes on allocating, the server is SIGKILLed and the copy restored; the
server starts on it (nothing at start can tell). Then ``grace.json`` cannot be written:
its temporary file's path is taken by a directory, so opening it fails (an OSError, as
ENOSPC would). The worker's next call proves the restore.

Before, the proof raised out of ``journal_behind`` at ``begin_grace``: the worker
was told an unexpected error, no session was ended, no grace began in memory, the
worker's instance was marked settled (proving nothing again), and the server went on
serving: a new worker attached at once and was handed the blocks the first worker
still held. Now the server keeps the grace in memory, journals no fencing (a restart
must still see the journal behind when its grace was never written), tells the prover
UNAVAILABLE (it keeps the fence that proves the restore), and stops serving (exit 4, as after a failed lease-marker write): no
block is handed out by it; restarted once the file can be written, the worker's next
call proves the restore again and its grace holds."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from durable_server import (
    attach,
    leased_server,
    restore_volume,
    step_allocate,
    workers_told_more_than_the_copy,
)
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, GracePeriodError, KVCoordError, SessionExpiredError
from kvcoord.service.main import EXIT_JOURNAL_FAILED
from kvcoord.service.startup import GRACE_FILE


def test_a_restore_proven_while_its_grace_cannot_be_written_hands_out_no_held_block(tmp_path: Path) -> None:
    lease = 6.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        a, _, told = workers_told_more_than_the_copy(server, lease, copy)
        restore_volume(server, copy)
        (server.data_dir / (GRACE_FILE + ".tmp")).mkdir()  # grace.json cannot be written
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            # the proof: told UNAVAILABLE (worker a keeps the fence that proves it)
            with pytest.raises(KVCoordError, match="its grace period cannot be written") as told_a:
                step_allocate(c, a, "a3", 4)
            assert not isinstance(told_a.value, FencedError)
            # No worker may be handed a2's blocks while worker a may still hold them:
            # refused for the grace, or the server has stopped serving.
            given: list[int] = []
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                try:
                    d = attach(c, "worker-d", lease)
                    given = step_allocate(c, d, "d1", 48)  # every free block of the copy (12)
                    break
                except (GracePeriodError, KVCoordError):
                    time.sleep(0.1)
            assert not set(given) & set(told), f"blocks {sorted(set(given) & set(told))} handed out twice"
        assert server.proc is not None
        assert server.proc.wait(60) == EXIT_JOURNAL_FAILED, server.log()  # stopped loudly
        assert "its grace period cannot be written" in server.log()
        server._log.close()
        # Space freed, restarted: nothing was fenced or settled in the journal, so worker
        # a's retry proves the restore again, and this time its grace holds.
        (server.data_dir / (GRACE_FILE + ".tmp")).rmdir()
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(FencedError):
                step_allocate(c, a, "a4", 4)
            with pytest.raises(GracePeriodError):
                attach(c, "worker-e", lease)
    finally:
        server.stop()


def test_a_start_told_restored_whose_grace_cannot_be_written_refuses_to_start(tmp_path: Path) -> None:
    """``kvcoord serve --restored`` fences at start, after writing the grace: when it
    cannot be written the start is refused with the data directory's exit status (3)
    naming the file (it was a raw IsADirectoryError traceback, exit 1)."""
    lease = 6.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            step_allocate(c, attach(c, "worker-a", lease), "a1", 8)
        server.kill()
        (server.data_dir / (GRACE_FILE + ".tmp")).mkdir()
        with pytest.raises(RuntimeError, match="server exited with 3"):
            server.start(args=("--restored",))
        assert "its grace period cannot be written" in server.log()
    finally:
        server.stop()


def test_a_restored_journal_found_at_start_whose_grace_cannot_be_written_refuses_to_start(
    tmp_path: Path,
) -> None:
    """A journal restored alone from a backup (deploy/README.md, "Restore the journal":
    ``journal.progress`` says more was committed) is found behind at start, and its grace
    is written before the fencing's first record (recovery.py, ``before_fencing``). When
    grace.json cannot be written the start is refused with the data directory's exit
    status (3) naming the file, nothing fenced (it was a raw IsADirectoryError
    traceback, exit 1). Started again once the file can be written, the restore is still
    found: the grace holds and worker a's session is gone."""
    lease = 6.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    journal = server.data_dir / "journal.sqlite"
    backup = tmp_path / "backup.sqlite"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            step_allocate(c, a, "a1", 8)
            src, dst = sqlite3.connect(journal), sqlite3.connect(backup)
            src.backup(dst)
            dst.close()
            src.close()
            step_allocate(c, a, "a2", 8)  # committed after the backup: journal.progress says so
        server.kill()
        for suffix in ("", "-wal", "-shm"):
            journal.with_name(journal.name + suffix).unlink(missing_ok=True)
        backup.rename(journal)
        (server.data_dir / (GRACE_FILE + ".tmp")).mkdir()  # grace.json cannot be written
        with pytest.raises(RuntimeError, match="server exited with 3"):
            server.start()
        assert "its grace period cannot be written" in server.log()
        assert str(server.data_dir / GRACE_FILE) in server.log()
        assert "Traceback" not in server.log()
        server._log.close()
        (server.data_dir / (GRACE_FILE + ".tmp")).rmdir()
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(GracePeriodError):
                attach(c, "worker-e", lease)
            with pytest.raises((SessionExpiredError, FencedError)):
                c.heartbeat(a.session_id, a.fence)
    finally:
        server.stop()
