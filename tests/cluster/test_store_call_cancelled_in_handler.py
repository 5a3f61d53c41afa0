"""A store call made inside a client's call (CreatePool's claim, DeletePool's delete in
the store) on a store client the replica replaced (ClusterStore.reconnect) when that
client is closed under it (ClusterStore._retire). gRPC ends such a call with
asyncio.CancelledError; the handler took it for its own cancellation and ended without
a status: the client was told nothing until its own deadline (DEADLINE_EXCEEDED; with
none, never). It is answered UNAVAILABLE (tasks.uncancelled: a cancellation the
handler was not asked for), and the client's retry, on the new store client, does
the call once.

A real replica (journal = "store", real gRPC) and a real etcd; the store call is held
on its way by a proxy that forwards nothing more of its connection (the old
connection a replica leaves), and the old client is closed before the call's
deadline ended it (the loaded machine's order, made certain by a long deadline)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from etcd_process import Etcd
from kvcoord.service import cluster_store
from kvcoord.service.cluster import Cluster
from kvcoord.service.server import RunningServer, start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from tcp_proxy import HoldingProxy
from test_replicas import POOL_CONFIG, in_process_store_replica

#: a bound on every wait here, not a measurement
BOUND = 30.0
#: no lease renewal falls while the store client is swapped (every LEASE / 3 s)
LEASE = 30
#: the deadline of the call cut under its handler (the old code never answered it: a
#: handler ended by a CancelledError sends no status)
CALL = 15.0


async def _cut_under_the_handler(cluster: Cluster, etcd: Etcd, marker: bytes, call: Awaitable[Any]) -> Any:
    """Run ``call`` (a client's gRPC call) while the replica's store client is one
    reaching etcd through a proxy that holds the store request carrying ``marker``;
    once held, the replica's client is the old one again and the proxied one is
    closed under the request. Returns how ``call`` ended (its answer or its error)."""
    proxy = HoldingProxy(etcd.endpoint, marker)
    old = cluster_store.store_client(proxy.address, 600.0)
    await old.connect()
    new, cluster.client = cluster.client, old
    task = asyncio.ensure_future(call)
    try:
        for _ in range(int(BOUND / 0.05)):
            if proxy.marker_at is not None or task.done():
                break
            await asyncio.sleep(0.05)
        cluster.client = new  # reconnect(): the new client is the one used from now on
        assert proxy.marker_at is not None, (
            f"the store call did not reach the proxy within {BOUND} s ({task!r})"
        )
        await cluster_store.close_client(old, 5.0)  # _retire(): the call's channel closed
        await asyncio.wait([task], timeout=BOUND)
        assert task.done(), f"the call was not answered within {BOUND} s"
        try:
            return task.result()
        except grpc.aio.AioRpcError as exc:
            return exc
    finally:
        cluster.client = new
        task.cancel()
        proxy.close()


async def _retried(call: Callable[[], Awaitable[Any]]) -> Any:
    """``call`` again while it answers UNAVAILABLE (the watch settling the view): bounded."""
    for _ in range(int(BOUND / 0.5)):
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            await asyncio.sleep(0.5)
    return await call()


def _unavailable(outcome: Any) -> None:
    assert isinstance(outcome, grpc.aio.AioRpcError), outcome
    # (was: DEADLINE_EXCEEDED, the handler ended by the store call's CancelledError, no status sent)
    assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome
    assert "cancelled under it" in (outcome.details() or ""), outcome.details()


def _on_a_replica(
    etcd: Etcd,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    case: Callable[[RunningServer, Cluster, pb_grpc.AllocatorStub], Awaitable[None]],
) -> None:
    """Run ``case(running, cluster, stub)`` on a real store replica named after the test
    (its server, its cluster, a stub of a channel to it); the replica stopped after."""
    address, cfg = in_process_store_replica(etcd.endpoint, request.node.name[:40], tmp_path, LEASE)

    async def run() -> None:
        running = await start_server(cfg)
        cluster = running.cluster
        assert cluster is not None
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await case(running, cluster, pb_grpc.AllocatorStub(channel))
        finally:
            await running.stop(grace=0)

    asyncio.run(run())


def test_a_create_whose_claim_is_closed_under_it_is_unavailable_and_made_once_by_the_retry(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async def case(running: RunningServer, cluster: Cluster, stub: pb_grpc.AllocatorStub) -> None:
        create = pb.CreatePoolRequest(name="p", config=POOL_CONFIG)
        _unavailable(
            await _cut_under_the_handler(
                cluster, etcd, cluster.key("owners", "p"), stub.CreatePool(create, timeout=CALL)
            )
        )
        assert "p" not in running.servicer.registry.pools
        answer = await _retried(lambda: stub.CreatePool(create))
        assert answer.created
        assert (await stub.GetPool(pb.GetPoolRequest(name="p"))).pool.name == "p"
        assert list(running.servicer.registry.pools) == ["p"]
        held = cluster.view.claims["p"]
        assert held.replica_id == "r0"

    _on_a_replica(etcd, tmp_path, request, case)


def test_a_delete_whose_store_delete_is_closed_under_it_is_unavailable_and_done_by_the_retry(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async def case(running: RunningServer, cluster: Cluster, stub: pb_grpc.AllocatorStub) -> None:
        created = await _retried(lambda: stub.CreatePool(pb.CreatePoolRequest(name="d", config=POOL_CONFIG)))
        assert created.created
        delete = pb.DeletePoolRequest(name="d")
        _unavailable(
            await _cut_under_the_handler(
                cluster, etcd, cluster.key("owners", "d"), stub.DeletePool(delete, timeout=CALL)
            )
        )
        # the held delete never reached etcd: the pool is still here and served
        assert (await stub.GetPool(pb.GetPoolRequest(name="d"))).pool.name == "d"
        await _retried(lambda: stub.DeletePool(delete))
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.GetPool(pb.GetPoolRequest(name="d"))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND, gone.value
        assert "d" not in running.servicer.registry.pools
        rows = await cluster.client.get_prefix(cluster.key("pools"))
        assert [kv.key for kv in rows] == []

    _on_a_replica(etcd, tmp_path, request, case)
