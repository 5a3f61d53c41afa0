"""A lease marker write that never returns (``leases.json`` on a hung disk) stops the
server as a stalled journal commit does: within ``journal_stall_seconds`` (here 2 s, half
the 4 s session lease) health turns NOT_SERVING, the renewal that needed the
marker is refused UNAVAILABLE, and the process exits with status 4 for its supervisor;
restarted, it holds every acknowledged allocation. (Before, the marker's thread hung
holding the file's lock, and the first lease past the bound on disk made the event
loop wait for that lock for ever: every call of every pool unanswered, health
unanswered, the process never exiting: a stall past every lease.)"""

from __future__ import annotations

import time
from pathlib import Path

import durable_server
import grpc
import pytest
from durable_server import assert_not_serving, leased_server, restarted_holding, step_allocate
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb

#: the server process's ``sitecustomize``: once FLAG exists, every write of the lease
#: marker blocks for good (its thread never returns, as on a hung disk)
_HANG_MARKER = """
import os
import threading

from kvcoord.service import lease_marker

_real = lease_marker.write_synced


def _write(path, text):
    if os.path.exists({flag!r}):
        threading.Event().wait()
    return _real(path, text)


lease_marker.write_synced = _write
"""


def test_a_hung_lease_marker_write_stops_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcoord.service.main import EXIT_JOURNAL_FAILED

    lease = 4.0
    flag = tmp_path / "hang"
    durable_server.with_sitecustomize(tmp_path, _HANG_MARKER.format(flag=str(flag)), monkeypatch)
    server = leased_server(tmp_path, lease, num_blocks=64, stall=lease / 2)
    server.start()
    try:
        with KVCoordClient(server.address, retry=NO_RETRY, timeout=30.0) as c:
            a = c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=lease)  # marker written
            acked = step_allocate(c, a, "r0", 8)
            flag.touch()  # from now on the marker's next write hangs
            attached = time.monotonic()
            refused: grpc.StatusCode | None = None
            while refused is None and time.monotonic() < attached + 10 * lease:
                try:  # each renewal needs the marker to cover it; past half its headroom, a write
                    c.stub.Heartbeat(
                        pb.HeartbeatRequest(session_id=a.session_id, fence=a.fence), timeout=lease
                    )
                except grpc.RpcError as exc:
                    refused = exc.code()
                time.sleep(0.1)
            assert refused == grpc.StatusCode.UNAVAILABLE, refused
            assert_not_serving(c)
        assert server.proc is not None
        assert server.proc.wait(60) == EXIT_JOURNAL_FAILED, server.log()
    finally:
        server.stop()
    flag.unlink()
    with restarted_holding(server, {"r0": acked}, "lease marker", "stalled", "journal_stall_seconds"):
        pass
