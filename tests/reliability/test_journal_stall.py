"""A journal commit that never returns (a hung disk or fsync) stops the server as a
failed write does: health NOT_SERVING, the calls waiting on it and every later
mutation UNAVAILABLE, exit status 4 for a supervisor to restart it; restarted, it holds
every acknowledged call. (Before, health stayed SERVING and every mutating call waited
on durability for ever: a stall past every lease, and nothing restarted the server.)"""

from __future__ import annotations

import threading
from pathlib import Path

import durable_server
import grpc
import pytest
from durable_server import DurableServer, assert_not_serving, one_block_step, restarted_holding, small_pool
from kvcoord.client import KVCoordClient

#: the server process's ``sitecustomize``: once FLAG exists, every journal write blocks
#: for good (the writer thread never returns, as on a hung disk)
_HANG_COMMITS = """
import os
import threading

from kvcoord.service import journal

_real = journal.JournalStore.write


def _write(self, records, chunk=None):
    if os.path.exists({flag!r}):
        threading.Event().wait()
    return _real(self, records, chunk)


journal.JournalStore.write = _write
"""


def test_a_hung_journal_commit_stops_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcoord.service.main import EXIT_JOURNAL_FAILED

    flag = tmp_path / "hang"
    durable_server.with_sitecustomize(tmp_path, _HANG_COMMITS.format(flag=str(flag)), monkeypatch)
    server = DurableServer(tmp_path, small_pool(64))
    server.config.write_text(
        server.config.read_text().replace(
            "snapshot_every = 2000\n", "snapshot_every = 2000\njournal_stall_seconds = 1.0\n"
        )
    )
    server.start()
    codes: dict[int, grpc.StatusCode] = {}
    try:
        with KVCoordClient(server.address, timeout=30.0) as c:
            a = c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=60)
            acked = list(
                c.stub.Step(one_block_step(a, 0), timeout=30).results[0].allocate.new_block_ids[0].block_ids
            )
            flag.touch()

            def call(i: int) -> None:
                try:
                    c.stub.Step(one_block_step(a, i), timeout=30)
                    codes[i] = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    codes[i] = exc.code()

            waiting = [threading.Thread(target=call, args=(i,)) for i in (1, 2)]
            for t in waiting:  # both wait on durability: the first commit hangs
                t.start()
            for t in waiting:
                t.join(60)
            assert codes == {1: grpc.StatusCode.UNAVAILABLE, 2: grpc.StatusCode.UNAVAILABLE}, codes
            assert_not_serving(c)
        assert server.proc is not None
        assert server.proc.wait(60) == EXIT_JOURNAL_FAILED, server.log()
    finally:
        server.stop()
    flag.unlink()
    with restarted_holding(server, {"r0": acked}, "stalled", "journal_stall_seconds"):
        pass
