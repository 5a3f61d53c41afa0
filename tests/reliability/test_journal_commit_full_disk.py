"""A journal COMMIT that fails (the disk fills as the commit writes the WAL: EFBIG, as
on a full disk) is a failed write like any other: the call waiting on it is told
UNAVAILABLE, never answered as durable; the server stops serving and exits 4; SQLite
rolled the transaction back (JournalStore.write raises the COMMIT's own error, with no
transaction left open), so restarted, the journal holds every acknowledged call and
nothing the failed commit carried, and its progress file does not claim more
(JournalStore.behind is empty: no restore is suspected).

A real ``kvcoord serve`` process; the disk fills where it happens (RLIMIT_FSIZE set on
the running server a few WAL pages above the WAL's size: its next commits fail)."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import grpc
from durable_server import DurableServer, assert_not_serving, one_block_step, small_pool
from kvcoord.client import NO_RETRY, KVCoordClient

#: keyed Steps sent at most before the disk must have filled (a few WAL pages each)
MAX_STEPS = 500


def test_a_commit_that_fails_on_a_full_disk_is_never_acknowledged(tmp_path: Path) -> None:
    from kvcoord.service.main import EXIT_JOURNAL_FAILED

    server = DurableServer(tmp_path, small_pool(2 * MAX_STEPS))
    server.start()
    acked: dict[str, list[int]] = {}
    failed: grpc.RpcError | None = None
    try:
        with KVCoordClient(server.address, timeout=30.0, retry=NO_RETRY) as c:
            s = c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=120)
            wal = server.data_dir / "journal.sqlite-wal"
            cap = os.path.getsize(wal) + 32 * 1024
            assert server.proc is not None
            resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (cap, cap))
            for i in range(MAX_STEPS):  # bounded: the WAL reaches the cap within a few dozen
                try:
                    answer = c.stub.Step(one_block_step(s, i), timeout=30)
                except grpc.RpcError as exc:
                    failed = exc
                    break
                acked[f"r{i}"] = list(answer.results[0].allocate.new_block_ids[0].block_ids)
            assert failed is not None, "the disk never filled"
            assert failed.code() == grpc.StatusCode.UNAVAILABLE, failed
            assert "failed: disk I/O error" in (failed.details() or ""), failed.details()
            assert_not_serving(c)
        assert server.proc.wait(60) == EXIT_JOURNAL_FAILED, server.log()
        log = server.log()
        assert "disk I/O error" in log or "full" in log, log  # the COMMIT's own error, not a later one
    finally:
        server.stop()
    assert acked, "no call was acknowledged before the disk filled"
    server.start()
    try:
        with KVCoordClient(server.address, timeout=30.0) as c:
            held = {
                r.request_id: list(r.groups[0].block_ids)
                for r in c.inspect_pool("p", all_requests=True).requests
            }
        assert held == acked  # every acknowledged call, nothing of the failed commit
        with KVCoordClient(
            server.address, timeout=30.0, retry=NO_RETRY
        ) as c:  # the retry its answer asks for
            again = c.stub.Step(one_block_step(s, len(acked)), timeout=30)
            given = list(again.results[0].allocate.new_block_ids[0].block_ids)
            assert c.stub.Step(one_block_step(s, len(acked)), timeout=30) == again  # (applied once)
            held = {
                r.request_id: list(r.groups[0].block_ids)
                for r in c.inspect_pool("p", all_requests=True).requests
            }
        assert held == {**acked, f"r{len(acked)}": given}
        assert "may be behind what clients were told" not in server.log(), (
            server.log()
        )  # progress did not lead
    finally:
        server.stop()
