"""A replica whose etcd member is cut off from the other two (a minority partition):
that member keeps running and its client port keeps answering (status), but it has
no leader and commits nothing: lease renewals, linearizable reads and writes through
it hang until their deadline. The other two keep the quorum. Real processes: a
3-member etcd whose peer URLs are proxies (etcd_process.EtcdCluster.isolate), two
kvcoord replicas with the journal in the store, a client allocating and freeing in
every pool meanwhile.

r0 lists the member first (its channel uses it), r1 lists it last; the member is
the leader when it is cut off (with replicas), or a follower (the store connection
alone). Whatever r0 does
(moves to a member of the majority and keeps its lease, or loses it and r1 takes its
pools over from the store), every pool is served again by one replica, every
acknowledged allocation is there, and no block is held by two requests (a deposed
owner's late answer, had it given one, would be missing from the rebuilt pool or
overlap another's blocks). Every wait is bounded; nothing measures speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from durable_server import env
from etcd_process import EtcdCluster
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.service import cluster_store
from kvcoord.service.cluster import Cluster
from kvcoord.service.cluster_store import store_client
from kvcoord.service.ownership import Member
from test_failover import LEASE, Worker, _config, check, create_and_attach, listed, wait_served
from test_keepalive import _follows, _member_ids, _member_in_use
from test_replicas import placed_many

#: the member cut off (first of r0's endpoints)
CUT = 0
#: seconds the partition lasts: several leases, so a replica that could not renew
#: would have lost its lease and its pools been taken over
PARTITION = 4 * LEASE
#: a bound on each wait for every pool to be served (not a measurement)
BOUND = 40.0


@pytest.fixture(scope="module")
def etcd3p(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Three etcd members whose peer links go through proxies (one can be isolated)."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd3p"), peer_proxies=True)
    try:
        yield cluster
    finally:
        cluster.stop()


def _served_once(procs: dict[str, ServerProcess], pools: list[str]) -> dict[str, list[str]]:
    """Until each pool is listed by exactly one replica (asked one by one), within
    BOUND; pool -> the replicas listing it, as last seen."""
    deadline = time.monotonic() + BOUND
    while True:
        by: dict[str, list[str]] = {pool: [] for pool in pools}
        for replica, proc in procs.items():
            for pool in listed([proc.address]):
                by.setdefault(pool, []).append(replica)
        if all(len(by[pool]) == 1 for pool in pools) or time.monotonic() > deadline:
            return by
        time.sleep(0.3)


@pytest.mark.long
def test_a_replica_whose_store_member_lost_the_quorum_loses_nothing(
    etcd3p: EtcdCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = request.node.name[:40]
    e = etcd3p.endpoints
    endpoints = {
        "r0": [e[CUT], e[(CUT + 1) % 3], e[(CUT + 2) % 3]],
        "r1": [e[(CUT + 1) % 3], e[(CUT + 2) % 3], e[CUT]],
    }
    procs: dict[str, ServerProcess] = {}
    isolated = False
    try:
        for r, eps in endpoints.items():
            procs[r] = start_server(_config(eps, r, tmp_path / r, cluster, "store", 40), env=env())
        pools = placed_many("m", "r0", ["r0", "r1"], 2) + placed_many("m", "r1", ["r0", "r1"], 1)
        targets = [p.address for p in procs.values()]
        sessions = create_and_attach(targets, pools, 300)
        assert set(wait_served(targets, pools).values()) == {"r0", "r1"}
        worker = Worker(targets, sessions)
        worker.start()
        time.sleep(2.0)
        # the member cut off leads: until it sees it lost the quorum it still renews
        # leases itself, and the majority has to elect a leader first
        etcd3p.lead(CUT)
        etcd3p.isolate(CUT)
        isolated = True
        time.sleep(PARTITION)  # the client allocates and frees meanwhile
        during = worker.calls
        by = _served_once(procs, pools)
        assert all(len(by[pool]) == 1 for pool in pools), f"pools not served by one replica each: {by}"
        time.sleep(2.0)
        assert worker.calls > during, "nothing was acknowledged with the member cut off"
        log0 = procs["r0"].log()
        assert "renewing the cluster lease failed" in log0, "r0 did not use the member cut off"
        print(*(line for line in log0.splitlines() if "cluster" in line or "pool" in line), sep="\n")
        etcd3p.rejoin(CUT)
        isolated = False
        time.sleep(2.0)
        worker.finish()
        print(
            f"worker: {worker.calls} calls acknowledged, {worker.failures} failed (unknown outcome); "
            f"served during the partition by {by}"
        )
        wait_served(targets, pools)
        check(targets, worker)
    finally:
        if isolated:
            etcd3p.rejoin(CUT)
        for p in procs.values():
            p.stop()


@pytest.mark.parametrize("require_leader", [False, True], ids=["hangs", "answers-no-leader"])
def test_the_store_connection_leaves_a_member_that_lost_the_quorum(
    etcd3p: EtcdCluster, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, require_leader: bool
) -> None:
    """A replica's store connection (in this process) on the member then cut off:
    its calls there hang until their deadline ("hangs"), or, with etcd's require-leader
    metadata on every call, are answered at once "etcdserver: no leader"
    ("answers-no-leader": an error is an answer, yet no renewal succeeded). Either way
    the connection moves to a member of the majority, the lease is kept (the same
    lease, alive in the store after several of its periods) and the watch follows."""
    name = request.node.name[:40]
    if require_leader:

        def leader_required(endpoint: str, timeout: float) -> Any:
            client = store_client(endpoint, timeout)
            client.metadata = (("hasleader", "true"),)
            return client

        monkeypatch.setattr(cluster_store, "store_client", leader_required)
    e = etcd3p.endpoints
    lease = 3

    async def run() -> None:
        ids = await _member_ids(etcd3p)
        cluster = Cluster(
            [e[CUT], e[(CUT + 1) % 3], e[(CUT + 2) % 3]], name, Member("r0", "127.0.0.1:1001"), lease, 1.0
        )
        await cluster.connect()
        await cluster.register()
        await cluster.refresh()
        loop = asyncio.get_running_loop()
        cluster.tasks = [loop.create_task(cluster._watch()), loop.create_task(cluster._keep_alive())]
        other = store_client(e[(CUT + 1) % 3], 2.0)
        await other.connect()
        isolated = False
        try:
            assert await _member_in_use(cluster.client, ids) == CUT
            await asyncio.to_thread(etcd3p.lead, (CUT + 1) % 3)  # the member cut off follows
            etcd3p.isolate(CUT)
            isolated = True
            for _ in range(int(BOUND / 0.5)):
                await asyncio.sleep(0.5)
                try:
                    if await _member_in_use(cluster.client, ids) != CUT:
                        break
                except Exception:  # noqa: BLE001 - the client being replaced
                    continue
            assert await _member_in_use(cluster.client, ids) != CUT, "still on the member cut off"
            await asyncio.sleep(2 * lease)  # renewed (or not) for two more lease periods
            alive = await other.get_lease_info(cluster.lease.id, keys=False)
            assert alive.TTL > 0, "the replica's lease ended: its renewals did not reach the quorum"
            await _follows(cluster, other, "after-minority")
        finally:
            if isolated:
                await asyncio.to_thread(etcd3p.rejoin, CUT)
            await other.close()
            await cluster.stop()

    asyncio.run(run())


def test_a_new_store_connection_is_never_made_to_a_member_without_a_leader(
    etcd3p: EtcdCluster, request: pytest.FixtureRequest
) -> None:
    """Each new connection (ClusterStore.reconnect: a renewal failed) starts at the
    next endpoint, round the list. A member cut off from the quorum still answers
    etcd's Status (no leader needed), and the connection was made to it when its turn
    came (a replica whose renewals failed twice on the majority, an election there,
    went back to the member that can commit nothing, and lost another renewal there):
    a member that names no leader is passed over while another endpoint has one."""
    e = etcd3p.endpoints

    async def run() -> None:
        ids = await _member_ids(etcd3p)
        cluster = Cluster(e, request.node.name[:40], Member("r0", "127.0.0.1:1001"), 3, 1.0)
        await cluster.connect()
        isolated = False
        try:
            assert await _member_in_use(cluster.client, ids) == 0
            await asyncio.to_thread(etcd3p.lead, 1)
            etcd3p.isolate(0)
            isolated = True
            for _ in range(int(BOUND / 0.2)):  # until member 0 knows it has no leader
                async with cluster_store.store_client(e[0], 2.0) as alone:
                    if (await alone.status()).leader is None:
                        break
                await asyncio.sleep(0.2)
            used = []
            for _ in range(2 * len(e)):  # every endpoint's turn comes, twice
                assert await cluster.reconnect()
                used.append(await _member_in_use(cluster.client, ids))
            assert 0 not in used, f"connected to the member cut off from the quorum: {used}"
        finally:
            if isolated:
                await asyncio.to_thread(etcd3p.rejoin, 0)
            await cluster.stop()

    asyncio.run(run())
