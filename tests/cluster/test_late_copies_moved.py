"""A copy of a keyed call delivered late to the replica that now owns its pool (real
etcd, two real replica processes on loopback, ``journal = "store"``).

r1 owns the pool. A session frees r1 with a keyed Step F (sent once, as it is, by a raw
stub), admits r1 again under the same id, and lets F's idempotency window pass at r1
(r1 refuses F's copy from then on: its key is forgotten, its call_sequence is at or
below the session's floor). Then the pool moves to r0: handed over (r1 stops, SIGTERM)
or rebuilt from the store after r1 dies (SIGKILL). A copy of F sent to r0 must be
refused as it was at r1 (ABORTED, ANSWER_EVICTED), never applied: applied, it frees the
live r1's blocks, which the pool then gives to another request while r1's worker still
writes them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate
from test_failover import wait_served
from test_replicas import POOL_CONFIG, placed, replica_config, wait_members

IDS = ["r0", "r1"]
#: a session's lease and the idempotency window (the shortest the config accepts for it)
LEASE = 3.0
WINDOW = 2 * LEASE
#: the store journal's stall bound: a 3 s lease must outlast it and its 1 s allowance in
#: the 95 % a client trusts (2.5 s < 2.85 s; the 10 s default is refused at load)
STALL = 1.5
PROMPT = list(range(1, 9))  # two full blocks of 4 tokens


def _config(etcd: Etcd, replica: str, data_dir: Path, cluster: str) -> str:
    return replica_config(
        etcd, replica, data_dir, cluster,
        server_lines=(
            f"session_lease_seconds = {LEASE}\nmax_session_lease_seconds = {LEASE}\n"
            f"idempotency_window_seconds = {WINDOW}\njournal_stall_seconds = {STALL}\n"
        ),
        cluster_lines='journal = "store"\nstore_snapshot_records = 40\n',
    )  # fmt: skip


@pytest.fixture
def replicas(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, ServerProcess]]:
    cluster = "late-" + request.node.callspec.id  # (one etcd per module: a cluster per test)
    procs: dict[str, ServerProcess] = {}
    try:
        for r in IDS:
            procs[r] = start_server(_config(etcd, r, tmp_path / r, cluster), env=env())
        wait_members(list(procs.values()), IDS)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _send(address: str, request: Any) -> pb.StepResponse:
    """``request`` sent once as it is (no client library, no retry, no redirect)."""
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.AllocatorStub(channel).Step(request, timeout=10)  # type: ignore[no-any-return]


def _late(address: str, request: Any) -> grpc.RpcError | None:
    """The error ``request`` sent again is refused with (None: it was answered)."""
    try:
        _send(address, request)
    except grpc.RpcError as exc:
        return exc
    return None


def _is_refused_as_late(err: grpc.RpcError | None) -> bool:
    if err is None:
        return False
    what = f"{err.code()} {err.details()}"
    assert err.code() == grpc.StatusCode.ABORTED, what
    assert ("kvcoord-reason", "ANSWER_EVICTED") in (err.trailing_metadata() or ()), what
    assert "is not applied now" in what, what
    return True


def _table(client: KVCoordClient, pool: str, rid: str) -> list[int]:
    held = {
        r.request_id: list(r.groups[0].block_ids)
        for r in client.inspect_pool(pool, all_requests=True).requests
    }
    return held.get(rid, [])


@pytest.mark.parametrize("move", ["handover", "failover"])
def test_a_late_copy_is_refused_by_the_pools_next_owner(
    replicas: dict[str, ServerProcess], move: str
) -> None:
    r0, r1 = replicas["r0"], replicas["r1"]
    pool = placed("late", "r1", IDS)
    with KVCoordClient([r0.address, r1.address], timeout=10, step_stream=False) as c:
        c.create_pool(pool, POOL_CONFIG)
        assert c.get_pool(pool).pool.replica == "r1"
        s = c.attach(pool, "sha256_cbor", 4, "0")
        sid, fence = s.session_id, s.fence
        assert c.step(pool, [allocate("r1", PROMPT, 8)], sid, fence).results[0].status_code == 0
        freeing = KVCoordClient.step.build(pool, [pb.Operation(free=pb.FreeOp(request_id="r1"))], sid, fence)
        assert freeing.call_sequence and freeing.idempotency_key
        assert _send(r1.address, freeing).results[0].status_code == 0
        assert c.step(pool, [allocate("r1", PROMPT, 8)], sid, fence).results[0].status_code == 0
        held = _table(c, pool, "r1")
        assert len(held) == 2
        # F's window passes at r1 (the session kept alive): until then a copy of F is
        # answered from memory (nothing applied), then refused
        deadline = time.monotonic() + 10 * WINDOW
        while not _is_refused_as_late(_late(r1.address, freeing)):
            assert time.monotonic() < deadline, "F's key was never forgotten at r1"
            c.heartbeat(sid, fence, pool=pool)
            time.sleep(0.2)
        # a keyed call past F's window: the journal (and the store's stream) holds one too
        reading = [pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="r1"))]
        assert c.step(pool, reading, sid, fence).results[0].status_code == 0
        assert _table(c, pool, "r1") == held
        free_before = c.get_stats(pool).num_free_blocks

    if move == "handover":
        assert r1.stop() == 0  # SIGTERM: r1 hands its pools over as it leaves
    else:
        r1.proc.kill()  # SIGKILL: r0 rebuilds the pool from the store once r1's lease ends
        r1.proc.wait(10)
    assert wait_served([r0.address], [pool]) == {pool: "r0"}

    with KVCoordClient(r0.address, timeout=10, step_stream=False) as c:
        c.heartbeat(sid, fence, pool=pool)
        assert _is_refused_as_late(_late(r0.address, freeing)), "r0 applied a late copy of F"
        assert _table(c, pool, "r1") == held
        assert c.get_stats(pool).num_free_blocks == free_before
