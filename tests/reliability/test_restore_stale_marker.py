"""A journal found behind what was committed at start, with a lease marker (leases.json)
restored from the same older copy (real server process, SIGKILL, real files)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from durable_server import attach, attach_after_grace, leased_server, step_allocate
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import GracePeriodError


def test_a_restore_found_at_start_waits_a_full_lease_whatever_a_restored_lease_marker_says(
    tmp_path: Path,
) -> None:
    """The journal and leases.json are copied together (a backup of the data directory's
    files, or a `cp` of a live one that reached journal.progress later); worker a keeps
    renewing and allocating long past the bound that copy of the marker names; the
    server is SIGKILLed and the copies put back while journal.progress stays current.
    The start finds the journal behind and fences it, and hands out no block for a full
    ``max_session_lease_seconds``: the marker it finds is as old as the journal, so it
    says nothing of the leases the lost history granted. (Before, a marker found was
    believed: its bound long past, the restore started with no grace at all, and a new
    worker attached at once and was handed a2's blocks, which worker a still held.)"""
    lease = 2.0
    server = leased_server(tmp_path, lease, num_blocks=9)
    data = server.data_dir
    old = tmp_path / "old"
    old.mkdir()
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            step_allocate(c, a, "a1", 8)
            for name in ("journal.sqlite", "journal.sqlite-wal", "leases.json"):  # the server is idle
                shutil.copy(data / name, old / name)
            until = time.monotonic() + 3 * lease  # past the copied marker's bound (2 leases ahead)
            while time.monotonic() < until:
                c.heartbeat(a.session_id, a.fence)
                time.sleep(lease / 4)
            told = step_allocate(c, a, "a2", 8)
            sent = time.monotonic()
        server.kill()
        (data / "journal.sqlite-shm").unlink(missing_ok=True)
        for name in ("journal.sqlite", "journal.sqlite-wal", "leases.json"):
            shutil.copy(old / name, data / name)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(GracePeriodError):
                attach(c, "worker-b", lease)
            b, attached = attach_after_grace(c, lease, "worker-b", 10 * lease)
            assert attached >= sent + lease  # worker a stopped using its ids before this
            assert set(step_allocate(c, b, "b1", 32)) & set(told)  # a2's blocks, but only now
        assert "journal behind what clients were told" in server.log()
    finally:
        server.stop()
