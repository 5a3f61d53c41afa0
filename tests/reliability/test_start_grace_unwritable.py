"""A grace period found at start that cannot be written to ``grace.json`` (a full disk,
an I/O error, a read-only data directory) must refuse the start with the data
directory's typed status (exit 3, naming the file), not a raw traceback (exit 1), and
must leave the data directory so that the next start still finds the grace.

Real server process, real files. The write fails because ``grace.json.tmp`` (the path
it is written through) is taken by a directory: opening it raises an OSError, as
ENOSPC or EROFS would (tests/reliability/test_restore_grace_unwritable.py does the same
for a restore's grace).

Two graces reach the write before the first answer (server.py, ``decision.persist``)
without being a restore: the full lease applied by ``--start-empty`` after a lost
journal, and a grace an earlier instance wrote and did not see to its end (carried).
Before, both escaped as ``IsADirectoryError`` (exit 1, a traceback); worse, for
``--start-empty`` the lost journal's evidence (``journal.progress``) had already been
moved aside, so the next plain start found no loss at all and started with no grace,
free to hand out blocks the lost journal's workers still held."""

from __future__ import annotations

from pathlib import Path

from durable_server import attach, leased_server, refused_for_grace, serve_once, step_allocate
from kvcoord.client import KVCoordClient
from kvcoord.service.main import EXIT_CANNOT_START, EXIT_JOURNAL_LOST
from kvcoord.service.startup import GRACE_FILE


def test_start_empty_whose_grace_cannot_be_written_refuses_and_keeps_the_loss(tmp_path: Path) -> None:
    lease = 30.0
    server = leased_server(tmp_path, lease, num_blocks=9)
    journal = server.data_dir / "journal.sqlite"
    progress = server.data_dir / "journal.progress"
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            step_allocate(c, attach(c, "worker-a", lease), "a1", 8)
        server.kill()
        evidence = progress.read_bytes()
        for suffix in ("", "-wal", "-shm"):
            journal.with_name(journal.name + suffix).unlink(missing_ok=True)
        blocker = server.data_dir / (GRACE_FILE + ".tmp")
        blocker.mkdir()  # grace.json cannot be written
        proc = serve_once(server.config, "--start-empty")
        assert proc.returncode == EXIT_CANNOT_START, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert str(server.data_dir / GRACE_FILE) in proc.stderr, proc.stderr
        # the loss is still on record: nothing was moved aside, a plain start refuses
        assert progress.read_bytes() == evidence
        assert not list(server.data_dir.glob("*.lost-*"))
        proc = serve_once(server.config)
        assert proc.returncode == EXIT_JOURNAL_LOST, proc.stderr
        # space freed: --start-empty starts, with its full grace
        blocker.rmdir()
        server.start(args=("--start-empty",))
        assert "started empty after a lost journal" in server.log()
        assert refused_for_grace(server.address, lease)
    finally:
        server.stop()


def test_a_carried_grace_that_cannot_be_written_again_refuses_to_start(tmp_path: Path) -> None:
    lease = 30.0
    server = leased_server(tmp_path, lease, num_blocks=9)
    journal = server.data_dir / "journal.sqlite"
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            step_allocate(c, attach(c, "worker-a", lease), "a1", 8)
        server.kill()
        for suffix in ("", "-wal", "-shm"):
            journal.with_name(journal.name + suffix).unlink(missing_ok=True)
        server.start(args=("--start-empty",))  # a full lease of grace, written
        assert (server.data_dir / GRACE_FILE).exists()
        server.kill()
        blocker = server.data_dir / (GRACE_FILE + ".tmp")
        blocker.mkdir()  # grace.json can be read but no longer written
        proc = serve_once(server.config)
        assert proc.returncode == EXIT_CANNOT_START, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert str(server.data_dir / GRACE_FILE) in proc.stderr, proc.stderr
        blocker.rmdir()
        server.start()  # the grace still holds
        assert refused_for_grace(server.address, lease)
    finally:
        server.stop()
