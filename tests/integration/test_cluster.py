"""The cluster stack of deploy/docker-compose.cluster.yml (three kvcoord replicas of the
image under test, etcd, Prometheus), as scripts/test.sh starts it: pools are created and
allocated through the replica set, a replica is stopped (`docker stop`: SIGTERM) and its
pools answer on the others with every acknowledged allocation, then it is started again
and takes back the pools placement gives it. Another is killed (`docker kill`: SIGKILL):
the replicas run the store journal (KVCOORD_CLUSTER_JOURNAL=store), so its pools are
rebuilt on the others from etcd, again with every acknowledged allocation.

  KVCOORD_CLUSTER_TARGETS     the replicas' advertised addresses, comma-separated
  KVCOORD_CLUSTER_CONTAINERS  replica_id=container, comma-separated (for docker stop/start)
  KVCOORD_CLUSTER_PROMETHEUS  host:port of the stack's Prometheus

Collected only when KVCOORD_CLUSTER_TARGETS is set (conftest.py); scripts/test.sh sets
all three. The replicas run in plaintext: handovers between TLS replicas are not
supported yet (deploy/README.md, "Scaling out")."""

from __future__ import annotations

import os
import subprocess
import uuid
from typing import Any

import pytest
from conftest import prom_query, wait_for
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.service.ownership import Member, owner_of
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate

TARGETS = [t for t in os.environ.get("KVCOORD_CLUSTER_TARGETS", "").split(",") if t]
CONTAINERS = dict(
    item.split("=", 1) for item in os.environ.get("KVCOORD_CLUSTER_CONTAINERS", "").split(",") if item
)
PROMETHEUS = os.environ.get("KVCOORD_CLUSTER_PROMETHEUS", "")

POOL_CONFIG = pb.PoolConfig(
    num_blocks=64, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
    groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
)  # fmt: skip
#: pools per replica: every replica owns some, so the one stopped has pools to hand over
POOLS_EACH = 2


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def serving(address: str) -> bool:
    try:
        with KVCoordClient(address, timeout=2, retry=NO_RETRY) as c:
            return bool(c.health() == "SERVING")
    except KVCoordError:
        return False


def members(replicas: list[str]) -> list[Member]:
    return [Member(r, "") for r in replicas]


def placement(pools: list[str], replicas: list[str]) -> dict[str, str]:
    """Where the servers' own rule (rendezvous hashing) puts each pool."""
    return {p: owner_of(p, members(replicas)).replica_id for p in pools}  # type: ignore[union-attr]


def listed(targets: list[str]) -> dict[str, str] | None:
    """pool -> the replica serving it, as the replica set lists them (None while one of
    ``targets`` does not answer)."""
    try:
        with KVCoordClient(targets, timeout=3, retry=NO_RETRY) as c:
            return {p.name: p.replica for p in c.list_pools().pools}
    except KVCoordError:
        return None


def wait_placed(targets: list[str], placed: dict[str, str], timeout: float = 90) -> None:
    """Wait until the replicas at ``targets`` (every one answering) list each pool of
    ``placed`` on its replica."""
    got = wait_for(lambda: (lambda now: now if now is not None and _sub(placed, now) else None)(listed(targets)),
                   timeout=timeout)  # fmt: skip
    assert got is not None and _sub(placed, got), f"pools not where placement puts them: {got} != {placed}"


def _sub(placed: dict[str, str], now: dict[str, str]) -> bool:
    return all(now.get(p) == r for p, r in placed.items())


class Holder:
    """One session per pool, allocating 2-block requests through the replica set and
    remembering each request's acknowledged blocks."""

    def __init__(self, client: KVCoordClient, pools: list[str]) -> None:
        self.client = client
        self.sessions: dict[str, Any] = {}
        self.acked: dict[str, dict[str, list[int]]] = {p: {} for p in pools}
        self.serial = 0
        for pool in pools:
            s = client.attach(pool, "sha256_cbor", 4, "0", client_name="cluster-suite", lease_seconds=120)
            self.sessions[pool] = s

    def allocate(self, per_pool: int) -> None:
        for pool, s in self.sessions.items():
            for _ in range(per_pool):
                self.serial += 1
                rid = f"r{self.serial}"
                op = allocate(rid, list(range(self.serial * 10, self.serial * 10 + 8)), 8).allocate
                got = self.client.allocate(pool, op, s.session_id, s.fence)
                assert not got.result.refused, pool
                self.acked[pool][rid] = list(got.result.new_block_ids[0].block_ids)

    def free_oldest(self) -> None:
        for pool, s in self.sessions.items():
            rid = next(iter(self.acked[pool]))
            self.client.free(pool, [rid], session_id=s.session_id, fence=s.fence)
            del self.acked[pool][rid]

    def check(self) -> None:
        """Each pool holds exactly the requests acknowledged to it, each with exactly its
        blocks, and no block is held by two requests: asked by a new client given the
        replica set (it learns each owner by a redirect). The holder's own client may
        still route a read to a stopped owner, whose address no longer answers at all:
        one DEADLINE_EXCEEDED (reads are not retried), then it asks the others."""
        with KVCoordClient(TARGETS, timeout=10) as fresh:
            self._check(fresh)

    def _check(self, client: KVCoordClient) -> None:
        for pool, held in self.acked.items():
            view = client.inspect_pool(pool, all_requests=True)
            got = {r.request_id: list(r.groups[0].block_ids) for r in view.requests}
            assert got == held, pool
            blocks = [b for ids in got.values() for b in ids]
            assert len(blocks) == len(set(blocks)), f"{pool}: a block held by two requests"


def pools_for(replicas: list[str]) -> list[str]:
    """Fresh pool names, POOLS_EACH placed on every replica."""
    tag = uuid.uuid4().hex[:6]
    chosen: dict[str, list[str]] = {r: [] for r in replicas}
    i = 0
    while any(len(v) < POOLS_EACH for v in chosen.values()):
        name = f"stack-{tag}-{i}"
        owner = placement([name], replicas)[name]
        if len(chosen[owner]) < POOLS_EACH:
            chosen[owner].append(name)
        i += 1
    return sorted(n for v in chosen.values() for n in v)


def create_and_fill(client: KVCoordClient, pools: list[str], placed: dict[str, str]) -> Holder:
    """Create ``pools`` through the replica set, wait until each is served where
    ``placed`` says, and allocate 4 requests in each (one session per pool)."""
    for pool in pools:
        client.create_pool(pool, POOL_CONFIG)
    wait_placed(TARGETS, placed)
    holder = Holder(client, pools)
    holder.allocate(4)
    return holder


def scraped_owners() -> dict[str, str]:
    """pool -> replica, as Prometheus last scraped kvcoord_pool_owned from every replica."""
    rows = prom_query(PROMETHEUS, 'kvcoord_pool_owned{job="kvcoord"} == 1')
    return {r["metric"]["pool"]: r["metric"]["replica"] for r in rows}


@pytest.fixture(scope="module")
def replicas() -> list[str]:
    """The replica ids, in the order of TARGETS (each replica serving and a member)."""
    assert len(TARGETS) == 3 and len(CONTAINERS) == 3, (TARGETS, CONTAINERS)
    for address in TARGETS:
        assert wait_for(lambda a=address: serving(a), timeout=120), f"{address} not SERVING"
    return sorted(CONTAINERS)


def addresses(replicas: list[str], ids: list[str]) -> list[str]:
    """The advertised addresses of the replicas ``ids`` (TARGETS is in replica order)."""
    return [TARGETS[replicas.index(r)] for r in ids]


def stop(replica: str) -> None:
    proc = docker("stop", "-t", "60", CONTAINERS[replica], timeout=90)
    assert proc.returncode == 0, proc.stderr
    state = docker(
        "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", CONTAINERS[replica]
    ).stdout.split()
    assert state == ["exited", "0"], f"{replica} after SIGTERM: {state}"


@pytest.mark.timeout(600)
def test_a_stopped_replica_hands_its_pools_over_and_takes_them_back(replicas: list[str]) -> None:
    """Six pools (two per replica, by the servers' placement rule) are created through the
    replica set and hold requests of one session each. `docker stop` of a replica (exit
    0): its pools answer on the two others, placed by the rule over them, every
    acknowledged allocation intact and no block held twice, and the same sessions go on
    allocating and freeing. `docker start`: it joins again, takes back exactly the pools
    placement gives it, still with everything acknowledged. Prometheus scrapes all three
    replicas and sees each pool served once, by its owner."""
    pools = pools_for(replicas)
    everyone = placement(pools, replicas)
    victim = replicas[1]
    others = [r for r in replicas if r != victim]
    without = placement(pools, others)
    moved = sorted(p for p in pools if everyone[p] == victim)
    assert len(moved) == POOLS_EACH and all(without[p] != victim for p in pools)

    with KVCoordClient(TARGETS, timeout=10) as c:
        holder = create_and_fill(c, pools, everyone)
        holder.check()
        if PROMETHEUS:
            assert wait_for(lambda: all(scraped_owners().get(p) == everyone[p] for p in pools), timeout=60), (
                scraped_owners()
            )

        # SIGTERM: the victim hands its pools over before it exits
        stop(victim)
        wait_placed(addresses(replicas, others), without)
        holder.check()
        holder.allocate(2)  # the same sessions, on the pools' new owners
        holder.free_oldest()
        holder.check()
        if PROMETHEUS:
            up = wait_for(lambda: len(prom_query(PROMETHEUS, 'up{job="kvcoord"} == 0')) == 1, timeout=60)
            assert up, prom_query(PROMETHEUS, 'up{job="kvcoord"}')
            assert wait_for(lambda: all(scraped_owners().get(p) == without[p] for p in pools), timeout=60), (
                scraped_owners()
            )

        # started again: it joins and takes back what placement gives it, with the state
        # the others held for it
        proc = docker("start", CONTAINERS[victim])
        assert proc.returncode == 0, proc.stderr
        (victim_address,) = addresses(replicas, [victim])
        assert wait_for(lambda: serving(victim_address), timeout=120), f"{victim} not SERVING again"
        wait_placed(TARGETS, everyone)
        holder.check()
        holder.allocate(1)
        holder.check()
        if PROMETHEUS:
            assert wait_for(lambda: len(prom_query(PROMETHEUS, 'up{job="kvcoord"} == 1')) == 3, timeout=60)
        for pool, session in holder.sessions.items():
            c.detach(session.session_id, session.fence)
            c.delete_pool(pool)


@pytest.mark.timeout(600)
def test_a_killed_replica_fails_over(replicas: list[str]) -> None:
    """`docker kill` of a replica (SIGKILL: no handover): once its membership lease ends
    its pools answer on the two others, placed by the rule over them, rebuilt from the
    journal in etcd with every acknowledged allocation and no block held twice, and the
    same sessions go on allocating and freeing there. `docker start` brings it back: it
    takes back the pools placement gives it from the store, still with everything
    acknowledged. With `journal = "local"` the killed replica's pools are never served
    by another (its only journal is on its volume) and this test fails."""
    pools = pools_for(replicas)
    everyone = placement(pools, replicas)
    victim = replicas[2]
    others = [r for r in replicas if r != victim]
    with KVCoordClient(TARGETS, timeout=10) as c:
        holder = create_and_fill(c, pools, everyone)
        holder.check()
        proc = docker("kill", CONTAINERS[victim])
        assert proc.returncode == 0, proc.stderr
        state = docker(
            "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", CONTAINERS[victim]
        ).stdout.split()
        assert state == ["exited", "137"], f"{victim} after SIGKILL: {state}"
        wait_placed(addresses(replicas, others), placement(pools, others))
        holder.check()
        holder.allocate(2)  # the same sessions, on the pools' new owners
        holder.free_oldest()
        holder.check()
        assert docker("start", CONTAINERS[victim]).returncode == 0
        assert wait_for(lambda: serving(addresses(replicas, [victim])[0]), timeout=120), (
            f"{victim} not SERVING"
        )
        wait_placed(TARGETS, everyone)
        holder.check()
        holder.allocate(1)
        holder.check()
        for pool, session in holder.sessions.items():
            c.detach(session.session_id, session.fence)
            c.delete_pool(pool)
