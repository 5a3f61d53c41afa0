"""Waits of a replica that must end whatever the store does, against a real 3-member
etcd on loopback: the watch and the client's close with the store's answers lost, a
flush of the store journal whose write loop ended, and a leave whose handovers do not
finish within the grace. Each is bounded here by asyncio.wait (a bound, never a
measurement of speed): the old code waited forever."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from etcd_process import EtcdCluster
from kvcoord.service.cluster import Cluster
from kvcoord.service.cluster_store import store_client
from kvcoord.service.errors import ServiceError, Status
from kvcoord.service.ownership import Member, encode_claim, encode_member
from kvcoord.service.server import start_server
from kvcoord.service.store_journal import PoolStreams
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from tcp_proxy import Proxy
from test_replicas import POOL_CONFIG, in_process_store_replica, placed

#: no lease ends while a test holds the store's answers back
LEASE = 30
#: the deadline of each store call here (short: every call made deaf times out)
TIMEOUT = 0.5
#: failed passes of the watch a deaf store must cause (aetcd's watcher had 10 slots)
PASSES = 15
#: a bound on every wait here, not a measurement
BOUND = 60.0


async def _joined(endpoint: str, name: str, replica: str = "r0") -> Cluster:
    cluster = Cluster([endpoint], name, Member(replica, f"127.0.0.1:{1000 + len(replica)}"), LEASE, TIMEOUT)
    cluster.client = store_client(endpoint, TIMEOUT)
    await cluster.client.connect()
    await cluster.register()
    await cluster.refresh()
    return cluster


class _Count(logging.Handler):
    """Counts the log records whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.start):
            self.n += 1


async def _bounded(what: Any, message: str) -> Any:
    task = asyncio.ensure_future(what)
    done, _ = await asyncio.wait([task], timeout=BOUND)
    if not done:
        task.cancel()
        pytest.fail(message)
    return task.result()


@pytest.mark.long
def test_the_watch_and_stop_end_while_the_store_answers_nothing(
    etcd3: EtcdCluster, request: pytest.FixtureRequest
) -> None:
    """The replica reaches etcd through a proxy that drops whatever etcd sends: every
    call times out, and once the store journal's large writes have used up the
    connection's flow-control window nothing the client sends leaves either. The
    watch fails at every pass and is made again (it used to get stuck in aetcd's
    watch_prefix, or in the watch's cancel, once aetcd's 10-slot request queue was
    full); once etcd's answers come back the view follows the store again; and stop()
    returns (aetcd's close waited forever on that full queue: a stopping replica
    hung past every lease)."""
    name = request.node.name[:40]
    proxy = Proxy(etcd3.endpoints[0])
    failures = _Count("watching the cluster store failed")
    logging.getLogger("kvcoord.service.cluster").addHandler(failures)

    async def run() -> None:
        cluster = await _joined(proxy.address, name)
        other = store_client(etcd3.endpoints[1], 2.0)
        await other.connect()
        cluster.tasks = [asyncio.get_running_loop().create_task(cluster._watch())]
        try:
            await asyncio.sleep(0.5)  # the watch is made (not needed for the fault: it only helps it)
            proxy.deafen()
            for n in range(3):  # the store journal's writes: more than the window, answers lost
                try:
                    await cluster.client.put(cluster.key("journal", f"big{n}"), b"x" * 200_000)
                except Exception:  # noqa: BLE001 - times out: its answer is dropped
                    pass
            for _ in range(int(BOUND / 0.5)):  # bounded: the watch's passes fail, one by one
                if failures.n >= PASSES:
                    break
                cluster._changed.set()
                await asyncio.sleep(0.5)
            assert failures.n >= PASSES, f"the watch got stuck after {failures.n} failed passes"

            proxy.hear()
            proxy.cut()  # etcd's answers are lost on that connection for good: a fresh one
            proxy.heal()
            await other.put(cluster.key("owners", "moved"), encode_claim("r9", "127.0.0.1:9"))
            for _ in range(int(BOUND / 0.2)):  # bounded: the view follows the store again
                if "moved" in cluster.view.claims:
                    break
                cluster._changed.set()
                await asyncio.sleep(0.2)
            assert "moved" in cluster.view.claims, "the watch does not follow the store any more"
            proxy.deafen()  # and stop() with the answers lost again
            for n in range(3):
                try:
                    await cluster.client.put(cluster.key("journal", f"big{n}"), b"x" * 200_000)
                except Exception:  # noqa: BLE001 - times out: its answer is dropped
                    pass
        finally:
            await _bounded(cluster.stop(), "Cluster.stop() did not return while the store answered nothing")
            await other.close()
            proxy.close()

    try:
        asyncio.run(run())
    finally:
        logging.getLogger("kvcoord.service.cluster").removeHandler(failures)


async def _claimed(cluster: Cluster) -> tuple[int, PoolStreams, list[str]]:
    """Pool "p" claimed here, and the store journal's streams (the pools given up: lost)."""
    claim = await cluster.claim("p")
    assert claim is not None
    lost: list[str] = []
    streams = PoolStreams(lambda: cluster.client, cluster.prefix, lambda: True, 40)
    streams.on_lost = lost.append
    return claim.term, streams, lost


def _first_answer_held(cluster: Cluster) -> tuple[asyncio.Event, asyncio.Event]:
    """The next transaction is carried out by etcd; its answer is held back (``sent``
    is set) until ``answered`` is."""
    plain = cluster.client.transaction
    sent, answered = asyncio.Event(), asyncio.Event()

    async def answer_held(*a: Any, **kw: Any) -> Any:
        out = await plain(*a, **kw)
        if not sent.is_set():
            sent.set()
            await answered.wait()
        return out

    cluster.client.transaction = answer_held
    return sent, answered


async def _records(cluster: Cluster, streams: PoolStreams, pool: str) -> list[bytes]:
    return [kv.key for kv in await cluster.client.get_prefix(streams.pool_prefix(pool), keys_only=True)]


def test_a_flush_ends_when_the_write_loop_is_cancelled(
    etcd3: EtcdCluster, request: pytest.FixtureRequest
) -> None:
    """A record's transaction is in flight (etcd carried it out; its answer is on its
    way) when the store journal's write loop is cancelled. The flush waiting for it
    used to wait forever (only the loop resolves it): it ends with UNAVAILABLE, and the
    pool, whose record may or may not be in the store, is given up here (on_lost: its
    next owner rebuilds it from what the store has)."""
    name = request.node.name[:40]

    async def run() -> None:
        cluster = await _joined(etcd3.endpoints[0], name)
        try:
            term, streams, lost = await _claimed(cluster)
            streams.open("p", term, b"base")
            await _bounded(streams.flush(), "the base was not written")
            sent, answered = _first_answer_held(cluster)

            async def call() -> None:  # a call's handler: its record, then its flush
                streams.append("p", b"record")
                await streams.flush()

            flushing = asyncio.get_running_loop().create_task(call())
            await _bounded(sent.wait(), "the record was never written")
            assert streams._task is not None
            streams._task.cancel()  # the write loop ends (the loop's shutdown, a fault)
            with pytest.raises(ServiceError) as failed:
                await _bounded(flushing, "the flush waits for a write loop that was cancelled")
            assert failed.value.status == Status.UNAVAILABLE
            assert lost == ["p"] and not streams.is_open("p")
            answered.set()
        finally:
            await _bounded(cluster.stop(), "Cluster.stop() did not return")

    asyncio.run(run())


def test_a_flush_ends_when_a_commit_listener_fails(
    etcd3: EtcdCluster, request: pytest.FixtureRequest
) -> None:
    """A listener told of each settled batch (on_commit: the events shown to watchers)
    raises. It used to end the write loop with the records queued meanwhile unwritten,
    and their flush waited forever: the listener's error is logged, the loop goes on,
    the records are written and the flush returns."""
    name = request.node.name[:40]

    async def run() -> None:
        cluster = await _joined(etcd3.endpoints[0], name)
        try:
            term, streams, lost = await _claimed(cluster)
            sent, answered = _first_answer_held(cluster)

            def failing() -> None:
                raise RuntimeError("a listener's fault")

            streams.on_commit.append(failing)

            async def call(body: bytes) -> None:
                streams.append("p", body)
                await streams.flush()

            streams.open("p", term, b"base")
            first = asyncio.get_running_loop().create_task(call(b"one"))
            await _bounded(sent.wait(), "the base was never written")
            second = asyncio.get_running_loop().create_task(call(b"two"))  # queued behind it
            await asyncio.sleep(0)
            answered.set()
            await _bounded(first, "a flush waits forever once a commit listener failed")
            await _bounded(second, "the flush of a record queued when the listener failed waits forever")
            assert lost == [] and streams.is_open("p")
            assert len(await _records(cluster, streams, "p")) == 3  # base, one, two
        finally:
            await _bounded(cluster.stop(), "Cluster.stop() did not return")

    asyncio.run(run())


class _Unanswering(pb_grpc.ReplicasServicer):
    """A replica that takes every AdoptPool and never answers it (a peer stuck
    journaling, or cut off after the call reached it)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.ended: list[str] = []

    async def AdoptPool(self, request: pb.AdoptPoolRequest, context: Any) -> pb.AdoptPoolResponse:
        self.calls.append(request.pool)
        try:
            await asyncio.Event().wait()
        finally:
            self.ended.append(request.pool)
        raise AssertionError("never answered")


async def _unanswering_peer(endpoint: str) -> tuple[grpc.aio.Server, _Unanswering, str, Any]:
    """A started gRPC server whose Replicas service never answers, its address, and a
    store client connected to ``endpoint`` (the test's own)."""
    peer = grpc.aio.server()
    unanswering = _Unanswering()
    pb_grpc.add_ReplicasServicer_to_server(unanswering, peer)
    address = f"127.0.0.1:{peer.add_insecure_port('127.0.0.1:0')}"
    await peer.start()
    other = store_client(endpoint, 2.0)
    await other.connect()
    return peer, unanswering, address, other


def test_a_leave_whose_handovers_do_not_finish_ends_within_the_grace(
    etcd3: EtcdCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A replica (journal = "store", real gRPC) stops gracefully with four pools, and
    placement over the others names a replica that never answers AdoptPool. The leave
    used to hand them over one by one, up to 30 s each (two minutes here, past any
    grace or terminationGracePeriod); it ends within server.grace_seconds: the
    handovers still running are cancelled (the peer sees each call end), and each pool,
    not handed over, loses its claim with this replica's lease and keeps its catalog
    entry and its journal in the store, for whoever placement names to rebuild."""
    name = request.node.name[:40]
    address, cfg = in_process_store_replica(etcd3.endpoints[0], name, tmp_path, LEASE, grace=2.0)
    pools = [placed(f"leaving{n}-", "r0", ["r0", "r9"]) for n in range(4)]

    async def run() -> None:
        peer, unanswering, peer_address, other = await _unanswering_peer(etcd3.endpoints[1])
        lease = await other.lease(LEASE)
        await other.put(
            f"/kvcoord/{name}/members/r9".encode(), encode_member(Member("r9", peer_address)), lease=lease
        )
        running = await start_server(cfg)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.AllocatorStub(channel)
                for pool in pools:
                    await stub.CreatePool(pb.CreatePoolRequest(name=pool, config=POOL_CONFIG))
            await _bounded(running.stop(), "the leave waits for handovers past the grace")
            assert unanswering.calls, "no handover was tried"
            for _ in range(int(BOUND / 0.1)):  # bounded: each call's end reaches the peer
                if len(unanswering.ended) == len(unanswering.calls):
                    break
                await asyncio.sleep(0.1)
            assert sorted(unanswering.ended) == sorted(unanswering.calls), "a handover was left running"
            prefix = f"/kvcoord/{name}/".encode()
            keys = [kv.key.decode() for kv in await other.get_prefix(prefix, keys_only=True)]
            for pool in pools:
                assert f"/kvcoord/{name}/owners/{pool}" not in keys, f"{pool} is still claimed"
                assert f"/kvcoord/{name}/pools/{pool}" in keys, f"{pool} left the catalog"
                assert any(k.startswith(f"/kvcoord/{name}/journal/{pool}/") for k in keys), pool
        finally:
            with contextlib.suppress(Exception):  # (it ended by itself if the test ran long)
                await other.revoke_lease(lease.id)
            await other.close()
            await peer.stop(None)

    asyncio.run(run())


def test_the_watch_follows_the_store_while_pools_go_to_a_joiner_that_never_answers(
    etcd3: EtcdCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A replica (journal = "store", real gRPC) holds six pools that placement puts on
    a member that joins, and the joiner never answers AdoptPool. The rebalance used to
    hand them over one by one, up to 30 s each, inside the watch loop: for three
    minutes the watch's passes stopped (an orphaned pool was neither taken nor
    removed). It runs beside the watch, four at a time: a pool of the catalog placed
    here that nobody claims is dealt with meanwhile, and no more than four calls are
    open."""
    name = request.node.name[:40]
    address, cfg = in_process_store_replica(etcd3.endpoints[0], name, tmp_path, LEASE, grace=2.0)
    pools = [placed(f"joining{n}-", "r9", ["r0", "r9"]) for n in range(6)]

    async def run() -> None:
        peer, unanswering, peer_address, other = await _unanswering_peer(etcd3.endpoints[1])
        running = await start_server(cfg)
        lease = await other.lease(LEASE)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.AllocatorStub(channel)
                for pool in pools:
                    await stub.CreatePool(pb.CreatePoolRequest(name=pool, config=POOL_CONFIG))
            await other.put(
                f"/kvcoord/{name}/members/r9".encode(), encode_member(Member("r9", peer_address)), lease=lease
            )
            for _ in range(int(BOUND / 0.1)):  # bounded: the rebalance starts
                if unanswering.calls:
                    break
                await asyncio.sleep(0.1)
            assert unanswering.calls, "no handover was tried"
            # a pool of the catalog nobody claims, placed here, never acknowledged
            # anything (no journal): the watch's pass takes it and removes it (recover)
            orphan = f"/kvcoord/{name}/pools/{placed('orphan-', 'r0', ['r0', 'r9'])}".encode()
            await other.put(orphan, b"")
            for _ in range(int(BOUND / 0.2)):  # bounded: the watch's passes go on meanwhile
                if await other.get(orphan) is None:
                    break
                await asyncio.sleep(0.2)
            assert await other.get(orphan) is None, "the watch does nothing while pools are handed over"
            assert len(unanswering.calls) - len(unanswering.ended) <= 4, unanswering.calls
        finally:
            await _bounded(running.stop(), "the stop waits for a rebalance past the grace")
            with contextlib.suppress(Exception):
                await other.revoke_lease(lease.id)
            await other.close()
            await peer.stop(None)

    asyncio.run(run())
