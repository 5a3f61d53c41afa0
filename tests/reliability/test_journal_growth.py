"""The journal over long runs and restarts, with real server processes and files:
records hold what changed state (never what a reader was told), a clean stop
snapshots, and raising a limit never prevents a restart."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import cbor2
import grpc
import pytest
from durable_server import DurableServer, env
from kvcoord.client import KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

POOL = """
[[pools]]
name = "p"
num_blocks = 400
hash_block_size = 4
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true
[[pools.groups]]
type = "full"
block_size = 4
"""


def _sync(rid: str, num_tokens: int) -> pb.RequestSync:
    return pb.RequestSync(
        request_id=rid, append_token_ids=[7 + i for i in range(num_tokens)], new_request=True,
        append_block_hashes=[f"{rid}-{i}".encode().ljust(32, b".") for i in range(num_tokens // 4)],
    )  # fmt: skip


def _step(stub: Any, session: Any, ops: list[pb.Operation], key: str = "", state: bool = False) -> Any:
    request = pb.StepRequest(
        pool="p", session_id=session.session_id, fence=session.fence, ops=ops,
        idempotency_key=key, include_state=state,
    )  # fmt: skip
    return stub.Step(request, timeout=10)


def _records(data_dir: Path) -> list[list[Any]]:
    db = sqlite3.connect(str(data_dir / "journal.sqlite"))
    try:
        return [cbor2.loads(body) for (body,) in db.execute("SELECT body FROM records ORDER BY seq")]
    finally:
        db.close()


def _stop(server: DurableServer) -> None:
    """SIGTERM: a clean stop."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.log()
    server._log.close()


def test_records_hold_inputs_and_retries_after_a_restart_get_the_same_bytes(tmp_path: Path) -> None:
    """Scenario 12: a worker collecting another worker's events (include_state) is
    journaled as its request and a digest of its answer, not as the answer with the
    other worker's token ids; after SIGKILL the retried call, rebuilt by replay, is
    answered byte for byte as the first time. (Before, each such record held the
    answer: it grew with every other worker's events, with the square of the workers.)"""
    server = DurableServer(tmp_path, POOL)
    server.start()
    try:
        with KVCoordClient(server.address) as c, grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.AllocatorStub(channel)
            writer = c.attach("p", "sha256_cbor", 4, "0", "writer")
            reader = c.attach("p", "sha256_cbor", 4, "0", "reader")
            for i in range(6):  # the writer caches 6 x 256 tokens: BlockStored events with token ids
                op = pb.AllocateOp(request=_sync(f"w{i}", 256), num_new_tokens=256)
                _step(stub, writer, [pb.Operation(allocate=op)], key=f"w{i}")
            first = _step(stub, reader, [], key="collect", state=True)
            assert sum(len(e.block_stored.token_ids) for e in first.events) == 6 * 256
            server.kill()
        calls = [r for r in _records(server.data_dir) if r[0] == "call"]
        collect = [r for r in calls if r[4] == "collect"]
        assert len(collect) == 1
        assert len(cbor2.dumps(collect[0])) < 300  # the request, key, digests: no events
        assert all(isinstance(r[6], bytes) and len(r[6]) == 16 for r in calls)
        assert len(first.SerializeToString()) > 6 * 256  # what the old record held
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            again = _step(pb_grpc.AllocatorStub(channel), reader, [], key="collect", state=True)
        assert again.SerializeToString() == first.SerializeToString()
    finally:
        server.stop()


def _limits(server: DurableServer, **limits: int) -> None:
    text = server.config.read_text().split("[limits]")[0]
    server.config.write_text(text + "[limits]\n" + "".join(f"{k} = {v}\n" for k, v in limits.items()))


def _fill(server: DurableServer) -> None:
    """Two requests held, a third refused by max_requests_per_pool = 2 (journaled: the
    Step applied its first operation)."""
    with KVCoordClient(server.address) as c, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.AllocatorStub(channel)
        s = c.attach("p", "sha256_cbor", 4, "0", "worker")
        for rid in ("r1", "r2"):
            _step(stub, s, [pb.Operation(allocate=pb.AllocateOp(request=_sync(rid, 8), num_new_tokens=8))])
        answer = _step(
            stub, s, [pb.Operation(allocate=pb.AllocateOp(request=_sync("r3", 8), num_new_tokens=8))]
        )
        assert answer.results[0].status_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def _start_fails(server: DurableServer) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(server.config)],
        env=env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_raising_a_limit_never_prevents_a_restart(tmp_path: Path, stop: str) -> None:
    """Scenario 7: after a call refused by max_requests_per_pool, a restart with the
    limit raised starts and holds what was acknowledged, whether the server stopped
    cleanly (SIGTERM: a snapshot, nothing left to replay) or was killed (the records
    are replayed under the limits they were applied with); lowering it below what is
    held still refuses, naming the pool, the limit and the record. (Before, raising
    the limit made the next start exit 3.)"""
    server = DurableServer(tmp_path, POOL)
    _limits(server, max_requests_per_pool=2)
    server.start()
    try:
        _fill(server)
        if stop == "sigterm":
            _stop(server)
            assert _records(server.data_dir) == []  # the stop's snapshot covers every record
        else:
            server.kill()
        _limits(server, max_requests_per_pool=10, event_buffer=100)
        server.start()
        with KVCoordClient(server.address) as c:
            held = sorted(r.request_id for r in c.inspect_pool("p", all_requests=True).requests)
            assert held == ["r1", "r2"]
        server.kill()
        _limits(server, max_requests_per_pool=1)
        err = _start_fails(server)
        assert "pool 'p' holds 2 requests after " in err and "max_requests_per_pool 1" in err
        _limits(server, max_requests_per_pool=10)
        server.start()
        with KVCoordClient(server.address) as c:
            s = c.attach("p", "sha256_cbor", 4, "0", "more")
            for rid in ("r3", "r4", "r5"):  # the raised limit applies
                op = pb.AllocateOp(request=_sync(rid, 8), num_new_tokens=8)
                result = c.step("p", [pb.Operation(allocate=op)], s.session_id, s.fence).results[0]
                assert result.status_code == 0 and result.allocate.new_block_ids
        server.kill()
        server.start()  # its records replay under each limit in turn
        with KVCoordClient(server.address) as c:
            assert len(c.inspect_pool("p", all_requests=True).requests) == 5
    finally:
        server.stop()


def test_an_answer_cut_at_max_message_bytes_replays_as_cut_and_the_limit_can_grow(tmp_path: Path) -> None:
    """Scenarios 5 and 7 together: a reader's include_state answer is cut at
    max_message_bytes (events_more, the cursor left where delivery stopped). After a
    SIGKILL the replay must cut where the call did, or the replayed answer differs from
    the journaled digest and the server cannot start; and with max_message_bytes raised
    before the restart (a setting that changes no given answer) it starts too, the
    retried call is answered byte for byte, and the next call delivers the rest from
    where the cut left it, nothing missed and nothing twice."""
    server = DurableServer(tmp_path, POOL)
    small = 8 * 1024
    server.config.write_text(
        server.config.read_text().replace("[server]\n", f"[server]\nmax_message_bytes = {small}\n")
    )
    server.start()
    try:
        with KVCoordClient(server.address) as c, grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.AllocatorStub(channel)
            writer = c.attach("p", "sha256_cbor", 4, "0", "writer")
            reader = c.attach("p", "sha256_cbor", 4, "0", "reader")
            for i in range(6):  # 6 x 64 blocks stored: more events than one 8 KiB answer holds
                op = pb.AllocateOp(request=_sync(f"w{i}", 256), num_new_tokens=256)
                _step(stub, writer, [pb.Operation(allocate=op)], key=f"w{i}")
            first = _step(stub, reader, [], key="collect", state=True)
            assert first.events_more and 0 < len(first.events) < 6 * 64
            server.kill()
        server.config.write_text(
            server.config.read_text().replace(f"max_message_bytes = {small}", "max_message_bytes = 8388608")
        )
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.AllocatorStub(channel)
            again = _step(stub, reader, [], key="collect", state=True)
            assert again.SerializeToString() == first.SerializeToString()
            rest = _step(stub, reader, [], key="rest", state=True)
        assert not rest.events_more and not rest.events_gap
        # every stored token once: nothing missed, nothing twice
        assert sum(len(e.block_stored.token_ids) for e in [*first.events, *rest.events]) == 6 * 256
    finally:
        server.stop()


def test_a_workload_of_sliced_steps_is_snapshotted_and_recovers_from_the_snapshot(tmp_path: Path) -> None:
    """Every Step here (a batch of 256 frees and 256 allocations, as a loaded decode
    batch) takes longer than SLICE_SECONDS, so it is applied in slices and appends its
    record with its pool held, when no snapshot may start. The snapshot it made due is
    taken once the pool is given back: with snapshot_every = 10 the journal keeps a
    snapshot and a few records, and a SIGKILL then a restart from them brings every
    request back with its blocks. (Before, no snapshot was ever taken: the journal kept
    every Step, and the next start replayed them all.)"""
    server = DurableServer(tmp_path, POOL.replace("num_blocks = 400", "num_blocks = 4000"), snapshot_every=10)
    server.start()
    try:
        with KVCoordClient(server.address) as c, grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.AllocatorStub(channel)
            s = c.attach("p", "sha256_cbor", 4, "0", "worker")
            for i in range(40):
                ops = [pb.Operation(free=pb.FreeOp(request_id=f"r{i - 1}.{k}")) for k in range(256) if i]
                ops += [
                    pb.Operation(allocate=pb.AllocateOp(request=_sync(f"r{i}.{k}", 16), num_new_tokens=16))
                    for k in range(256)
                ]
                answer = _step(stub, s, ops, key=f"s{i}")
                assert all(r.status_code == 0 for r in answer.results)
            held = {
                r.request_id: list(r.groups[0].block_ids)
                for r in c.inspect_pool("p", all_requests=True).requests
            }
            server.kill()
        db = sqlite3.connect(str(server.data_dir / "journal.sqlite"))
        try:
            (snapshots,) = db.execute("SELECT count(*) FROM snapshots").fetchone()
            (records,) = db.execute("SELECT count(*) FROM records").fetchone()
        finally:
            db.close()
        assert snapshots == 1 and records < 30, (snapshots, records)
        server.start()
        with KVCoordClient(server.address) as c:
            view = c.inspect_pool("p", all_requests=True)
            assert {r.request_id: list(r.groups[0].block_ids) for r in view.requests} == held
            c.heartbeat(s.session_id, s.fence)  # recovered whole: the session goes on
    finally:
        server.stop()
