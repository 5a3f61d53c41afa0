"""Two failure paths of a replica's claims, with the faults made for real against a
3-member etcd on loopback: the store loses its quorum (two members SIGKILLed) while a
pool is taken over, and a claim transaction is carried out by etcd while its answer
is lost on the way back (a TCP proxy that drops what etcd sends).

Whatever happens, a pool claimed here whose state is not here is never served
(no NOT_FOUND for a pool that exists, no CreatePool making it again empty: its
history in the store would end there), the claim is given back or the pool rebuilt
at the next pass of the watch, and a claim etcd made is seen and held, never made
twice."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from etcd_process import EtcdCluster
from kvcoord.service.cluster import Cluster
from kvcoord.service.cluster_placement import ClusterPlacement
from kvcoord.service.cluster_store import store_client
from kvcoord.service.errors import ErrorReason, ServiceError, Status
from kvcoord.service.ownership import Member, decode_claim
from kvcoord.service.server import start_server
from kvcoord.service.store_journal import PoolStreams
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from tcp_proxy import Proxy
from test_replicas import POOL_CONFIG, in_process_store_replica

#: long enough that no lease ends while a test holds the store without quorum
LEASE = 30
#: passes tried while the store elects a leader or the client reconnects (a bound)
TRIES = 60


async def _joined(endpoint: str, name: str, replica: str = "r0") -> Cluster:
    cluster = Cluster([endpoint], name, Member(replica, f"127.0.0.1:{1000 + len(replica)}"), LEASE, 2.0)
    cluster.client = store_client(endpoint, 2.0)
    await cluster.client.connect()
    await cluster.register()
    await cluster.refresh()
    return cluster


def _store_journal(cluster: Cluster, local: list[str], loaded: list[int]) -> None:
    """journal = "store", without a registry: what would be loaded is recorded."""
    cluster.streams = PoolStreams(lambda: cluster.client, cluster.prefix, lambda: True, 40)
    cluster.local_pools = lambda: list(local)
    cluster.drop_local = local.remove

    async def load(value: dict[str, Any], term: int) -> None:
        loaded.append(term)

    cluster.load_pool = load
    cluster.scratch_registry = lambda writer: pytest.fail("no journal here: nothing is rebuilt")


async def _until(step: Callable[[], Awaitable[object]]) -> None:
    """Run ``step`` until it does not raise (the store electing a leader, the client
    reconnecting): at most TRIES times."""
    for _ in range(TRIES):
        try:
            await step()
            return
        except Exception:  # noqa: BLE001 - the store is not back yet
            await asyncio.sleep(0.5)
    await step()


def _refused_until_rebuilt(placement: ClusterPlacement, pool: str) -> None:
    """Every call of ``pool`` is told to retry here (it changes owner), not served."""
    with pytest.raises(ServiceError) as refused:
        placement.check(pool, local=False)
    assert refused.value.status == Status.UNAVAILABLE, refused.value
    assert refused.value.reason == ErrorReason.OWNER_CHANGING


async def _holder(client: Any, key: bytes) -> tuple[str, int] | None:
    """The claim at ``key`` as the store has it: (replica, lease id). Read until the
    store answers (a member restarted by the test before may still be catching up)."""
    got = None

    async def read() -> None:
        nonlocal got
        got = await client.get(key)

    await _until(read)
    if got is None:
        return None
    return decode_claim("", got.value, got.mod_revision).replica_id, got.lease


def test_a_claim_that_cannot_be_given_back_is_not_served_and_given_back_at_the_next_pass(
    etcd3: EtcdCluster, request: pytest.FixtureRequest
) -> None:
    """recover() claims an orphan; the store then loses its quorum (two of three etcd
    members SIGKILLed): the read of the pool's journal fails, and so does giving the
    claim back. The pool stays claimed here with no state here: its calls are told to
    retry (it used to pass the placement: NOT_FOUND, and CreatePool made it again,
    empty, over its history in the store). Once the quorum is back, the next pass of
    recover_orphans gives the claim back, and a later one reads the journal again."""
    name = request.node.name[:40]

    async def run() -> None:
        cluster = await _joined(etcd3.endpoints[0], name)
        placement = ClusterPlacement(cluster, SimpleNamespace(pools={}))  # type: ignore[arg-type]  # no pool here
        loaded: list[int] = []
        try:
            _store_journal(cluster, [], loaded)
            await cluster.client.put(cluster.key("pools", "orphan"), b"")  # in the catalog, unclaimed
            await cluster.refresh()
            assert "orphan" in cluster.view.orphans()
            plain_read = cluster.client.get_prefix
            lost: list[bool] = []

            async def quorum_lost(prefix: bytes, *a: Any, **kw: Any) -> Any:
                if prefix == cluster.streams.pool_prefix("orphan") and not lost:  # type: ignore[union-attr]
                    lost.append(True)  # the claim is made: now the store loses its quorum
                    await asyncio.to_thread(etcd3.kill, 1)
                    await asyncio.to_thread(etcd3.kill, 2)
                return await plain_read(prefix, *a, **kw)

            cluster.client.get_prefix = quorum_lost
            try:
                assert await cluster.recover("orphan") is False  # logged: read and release failed
                assert lost
                assert cluster.view.holds("orphan"), "the release cannot have succeeded without a quorum"
                _refused_until_rebuilt(placement, "orphan")
                with pytest.raises(ServiceError) as refused:
                    await placement.before_create("orphan")  # CreatePool: not made again, empty
                assert refused.value.status == Status.UNAVAILABLE
                # a pass of the watch meanwhile: the release fails again, logged, and the
                # pass goes on (other orphans, then the handovers; it used to raise out)
                await cluster.recover_orphans()
                assert cluster.view.holds("orphan")
            finally:
                await asyncio.to_thread(etcd3.restart, 1)
                await asyncio.to_thread(etcd3.restart, 2)
                await asyncio.to_thread(etcd3.wait_quorum, 30.0)
            cluster.client.get_prefix = plain_read

            await _until(cluster.refresh)
            assert cluster.view.holds("orphan")  # still held: nothing gave it back yet
            await cluster.recover_orphans()  # the next pass of the watch
            assert await _holder(cluster.client, cluster.key("owners", "orphan")) is None
            assert "orphan" in cluster.view.orphans()  # to be taken over again, after a pause
            cluster._retry_at.clear()  # the pause (lease_seconds) is over
            await cluster.recover_orphans()  # reads the journal: there is none, the pool is forgotten
            await cluster.refresh()
            assert "orphan" not in cluster.view.catalog and not loaded
        finally:
            await cluster.stop()

    asyncio.run(run())


def _answer_lost(proxy: Proxy, transaction: Callable[..., Awaitable[Any]], sent: list[int]) -> Any:
    """``transaction``, whose first call reaches etcd (which carries it out) but whose
    answer is dropped on the way back: the caller sees DEADLINE_EXCEEDED."""

    async def tx(*a: Any, **kw: Any) -> Any:
        sent.append(1)
        if len(sent) > 1:
            return await transaction(*a, **kw)
        proxy.deafen()
        try:
            return await transaction(*a, **kw)
        finally:
            proxy.hear()
            proxy.cut()  # the connection's stream of answers is broken: a fresh one
            proxy.heal()

    return tx


def test_a_claim_whose_answer_was_lost_is_held_at_the_next_pass(
    etcd3: EtcdCluster, request: pytest.FixtureRequest
) -> None:
    """claim_local claims a pool held here (local journal); etcd commits the claim
    but its answer is lost (the replica sees DEADLINE_EXCEEDED and logs it). The
    next refresh finds the claim under this replica's lease and holds the pool; the
    next pass claims nothing again and gives the registry the claim's term (its
    answers carry it)."""
    name = request.node.name[:40]
    proxy = Proxy(etcd3.endpoints[0])

    async def run() -> None:
        cluster = await _joined(proxy.address, name)
        other = store_client(etcd3.endpoints[1], 2.0)
        await other.connect()
        try:
            cluster.local_pools = lambda: ["mine"]
            terms: list[tuple[str, int]] = []
            cluster.on_term = lambda pool, term: terms.append((pool, term))
            sent: list[int] = []
            cluster.client.transaction = _answer_lost(proxy, cluster.client.transaction, sent)
            await cluster.claim_local()  # the answer is lost: logged, nothing raised
            assert sent == [1] and not cluster.view.holds("mine")
            holder = await _holder(other, cluster.key("owners", "mine"))
            assert holder == ("r0", cluster.lease.id), f"etcd did not carry the claim out: {holder}"

            await _until(cluster.refresh)
            assert cluster.view.holds("mine"), "the claim etcd made is not held"
            term = cluster.view.term("mine")
            await cluster.claim_local()  # the next pass
            assert sent == [1], "the pool was claimed twice"
            assert terms == [("mine", term)], "the registry does not know the claim's term"
        finally:
            await other.close()
            await cluster.stop()
            proxy.close()

    asyncio.run(run())


def test_a_rebuild_whose_claim_answer_was_lost_is_not_served_empty(
    etcd3: EtcdCluster, request: pytest.FixtureRequest
) -> None:
    """journal = "store": claim_local rebuilds a pool held here from the store
    (recover: the copy here is dropped first); etcd commits the claim, its answer is
    lost. Seen at the next refresh, the pool is claimed here with no state here: its
    calls are told to retry, never served (NOT_FOUND, or made again empty by
    CreatePool) until the pass that gives the claim back and takes it over again."""
    name = request.node.name[:40]
    proxy = Proxy(etcd3.endpoints[0])

    async def run() -> None:
        cluster = await _joined(proxy.address, name)
        placement = ClusterPlacement(cluster, SimpleNamespace(pools={}))  # type: ignore[arg-type]  # no pool here
        loaded: list[int] = []
        try:
            local = ["held"]
            _store_journal(cluster, local, loaded)
            sent: list[int] = []
            cluster.client.transaction = _answer_lost(proxy, cluster.client.transaction, sent)
            await cluster.claim_local()  # drops the copy here, claims: the answer is lost
            assert sent == [1] and local == []
            await _until(cluster.refresh)
            assert cluster.view.holds("held") and "held" in cluster.view.catalog
            _refused_until_rebuilt(placement, "held")
            with pytest.raises(ServiceError):
                await placement.before_create("held")
            await cluster.recover_orphans()  # gives the claim back, claims it again, reads the store
            assert len(sent) >= 3  # release, claim (and the catalog's cleanup: no journal here)
            await cluster.refresh()
            assert "held" not in cluster.view.claims and not loaded
        finally:
            await cluster.stop()
            proxy.close()

    asyncio.run(run())


def test_a_create_whose_claim_answer_was_lost_is_retried_and_made_once(
    etcd3: EtcdCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A real replica (journal = "store", real gRPC) reaches etcd through a proxy; the
    claim transaction of a CreatePool is carried out by etcd, its answer lost. The
    call is answered UNAVAILABLE (retry: it was INTERNAL, which no client retries);
    the retry makes the pool once, under the claim etcd made (this replica's lease),
    and it is served."""
    name = request.node.name[:40]
    proxy = Proxy(etcd3.endpoints[0])
    address, cfg = in_process_store_replica(proxy.address, name, tmp_path, LEASE)

    async def run() -> None:
        running = await start_server(cfg)
        cluster = running.cluster
        assert cluster is not None
        other = store_client(etcd3.endpoints[1], 2.0)
        await other.connect()
        try:
            sent: list[int] = []
            plain = cluster.client.transaction
            cluster.client.transaction = _answer_lost(proxy, plain, sent)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.AllocatorStub(channel)
                create = pb.CreatePoolRequest(name="p", config=POOL_CONFIG)
                with pytest.raises(grpc.aio.AioRpcError) as lost:
                    await stub.CreatePool(create)
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value
                assert await _holder(other, cluster.key("owners", "p")) == ("r0", cluster.lease.id)
                answer = None
                for _ in range(TRIES):  # bounded: the watch's next pass settles the claim
                    try:
                        answer = await stub.CreatePool(create)
                        break
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                        await asyncio.sleep(0.5)
                assert answer is not None and answer.created
                assert (await stub.GetPool(pb.GetPoolRequest(name="p"))).pool.name == "p"
                assert await _holder(other, cluster.key("owners", "p")) == ("r0", cluster.lease.id)
                assert list(running.servicer.registry.pools) == ["p"]
        finally:
            await other.close()
            await running.stop(grace=0)
            proxy.close()

    asyncio.run(run())
