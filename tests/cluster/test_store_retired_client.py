"""A pool's journal write in flight on a store client the replica replaced
(ClusterStore.reconnect) when that client is closed (ClusterStore._retire, once the
calls' deadlines passed). gRPC ends a call whose channel is closed under it with
asyncio.CancelledError; on a loaded machine a call's end by its deadline reached the
loop after that close (the CI failure of test_keepalive under two xdist workers: a
store call raised CancelledError). The journal took it for its own cancellation and
gave the pool up (its callers told UNAVAILABLE, the pool rebuilt elsewhere) where the
same write on the new client was all it needed; the replica's watch loop took it for its
own and ended for good (the view never followed the store again)."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import cbor2
import pytest
from etcd_process import Etcd, put_claim, store_client
from kvcoord.service import cluster_store
from kvcoord.service.cluster import Cluster
from kvcoord.service.ownership import Member, encode_claim
from kvcoord.service.store_journal import PoolStreams
from kvcoord.service.store_rebuild import stream_rows
from tcp_proxy import HoldingProxy

#: a bound on every wait here, not a measurement
BOUND = 30.0
#: the deadline of the replica's store calls (not of the held one): a loaded machine's
#: etcd answered a Status in more than 1 s
TIMEOUT = 5.0


async def _until_held(proxy: HoldingProxy, what: str) -> None:
    """Wait (bounded) until the store call carrying the proxy's marker is held there."""
    for _ in range(int(BOUND / 0.05)):
        if proxy.marker_at is not None:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"{what} did not reach the proxy within {BOUND} s")


async def _registered(etcd: Etcd, request: pytest.FixtureRequest, pool: str | None = None) -> Cluster:
    """Replica r0 of a cluster named after the test, connected and registered (holding
    state of ``pool`` when given)."""
    cluster = Cluster([etcd.endpoint], request.node.name[:40], Member("r0", "127.0.0.1:1001"), 30, TIMEOUT)
    if pool is not None:
        cluster.local_pools = lambda: [pool]
    await cluster.connect()
    await cluster.register()
    return cluster


async def _through_holding_proxy(
    cluster: Cluster, etcd: Etcd, marker: bytes
) -> tuple[HoldingProxy, Any, Any]:
    """The cluster's store client made one that reaches etcd through a proxy holding the
    call that carries ``marker`` (the old connection a replica leaves): the proxy, that
    old client and the cluster's own (the new one)."""
    proxy = HoldingProxy(etcd.endpoint, marker)
    old = cluster_store.store_client(proxy.address, 600.0)
    await old.connect()
    new, cluster.client = cluster.client, old
    return proxy, old, new


def test_a_write_on_a_replaced_client_closed_under_it_is_written_on_the_new_one(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    """The write is held on its way (a proxy that forwards nothing more of its
    connection: the old connection a replica leaves); the client is replaced and the
    old one closed before the write's deadline ended it (the loaded machine's order,
    made certain here by a deadline longer than the test). The write is made on the
    new client: committed, the pool kept, its caller answered."""
    prefix = f"/kvcoord/{request.node.name[:40]}/".encode()
    pool = "p"

    async def run() -> None:
        proxy = HoldingProxy(etcd.endpoint, b"journal/")
        old = cluster_store.store_client(proxy.address, 600.0)
        clients = [old]
        async with store_client(etcd) as new:
            streams = PoolStreams(lambda: clients[-1], prefix, lambda: True, snapshot_every=40)
            term = await put_claim(new, streams.owner_key(pool))
            lost: list[str] = []
            streams.on_lost = lost.append

            async def call() -> None:
                streams.open(pool, term, cbor2.dumps([0, ["base", 0.0, b"p"]]))
                await streams.flush()

            task = asyncio.create_task(call(), context=contextvars.Context())
            try:
                await _until_held(proxy, "the write")
                clients.append(new)  # reconnect(): the new client is the one read from now on
                await cluster_store.close_client(old, 5.0)  # _retire(): the write's channel closed
                await asyncio.wait([task], timeout=BOUND)
                assert task.done(), f"the write was not answered within {BOUND} s"
                task.result()  # (was: ServiceError UNAVAILABLE, the pool given up)
                assert lost == [] and streams.is_open(pool)
                rows = await new.get_prefix(streams.pool_prefix(pool))
                assert 0 in stream_rows(rows, streams.pool_prefix(pool))[term]
            finally:
                task.cancel()
                proxy.close()

    asyncio.run(run())


def test_the_watch_follows_again_after_a_read_closed_under_it(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    """The watch loop's read of the view (refresh) is held on its way; the client is
    replaced and the old one closed before the read's deadline ended it. The loop
    watches again on the new client: a claim put afterwards reaches the view."""

    async def run() -> None:
        cluster = await _registered(etcd, request)
        await cluster.refresh()
        # (the marker: the refresh's read of the catalog)
        proxy, old, new = await _through_holding_proxy(cluster, etcd, cluster.key("pools"))
        cluster.tasks = [asyncio.get_running_loop().create_task(cluster._watch())]
        try:
            await _until_held(proxy, "the watch's read")
            cluster.client = new  # reconnect()
            await cluster_store.close_client(old, 5.0)  # _retire(): the read's channel closed
            await new.put(cluster.key("owners", "after"), encode_claim("r9", "127.0.0.1:9"))
            for _ in range(int(BOUND / 0.1)):
                if "after" in cluster.view.claims:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the watch does not follow the store any more ({cluster.tasks[0]!r})")
        finally:
            await cluster.stop()
            proxy.close()

    asyncio.run(run())


def test_a_failed_handover_is_settled_again_after_its_reclaim_is_closed_under_it(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    """A handover failed; putting the pool's claim again (reclaim) is held on its way,
    and the client is replaced and the old one closed under it. The pool is not served
    meanwhile and is settled at the watch's next pass (it was left "changing owner" here
    for good: the CancelledError skipped both the retry list and the end of the move)."""
    pool = "p"

    async def run() -> None:
        cluster = await _registered(etcd, request, pool)
        claim = await cluster.claim(pool)
        assert claim is not None
        proxy, old, new = await _through_holding_proxy(cluster, etcd, cluster.key("owners", pool))
        cluster.view.moving.add(pool)  # (hand_over: being handed over)
        settle = asyncio.get_running_loop().create_task(
            cluster._settle_failed_handover(pool, claim.term, RuntimeError("the adopter did not answer"))
        )
        try:
            await _until_held(proxy, "the reclaim")
            cluster.client = new  # reconnect()
            await cluster_store.close_client(old, 5.0)  # _retire(): the reclaim's channel closed
            await asyncio.wait([settle], timeout=BOUND)
            assert settle.done() and not settle.cancelled(), settle
            settle.result()
            assert cluster._unsettled == {pool: claim.term} and pool in cluster.view.moving  # not served yet
            await cluster.claim_local()  # the watch's next pass
            assert cluster._unsettled == {} and pool not in cluster.view.moving
            again = cluster.view.claims[pool]
            assert again.replica_id == "r0" and again.term > claim.term  # served here under a new term
        finally:
            settle.cancel()
            await cluster.stop()
            proxy.close()

    asyncio.run(run())
