"""Failover without loss (``[cluster] journal = "store"``), with real processes: a
3-member etcd cluster and 3 kvcoord replicas, started here on loopback. A client
allocates and frees continuously while owners are SIGKILLed, an etcd member is
SIGKILLed, and an owner is cut off from the store (SIGSTOP past its lease). After
each blow every acknowledged allocation is where it was acknowledged, and no block is
held by two live requests."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from durable_server import env
from etcd_process import Etcd, EtcdCluster
from kvcoord.client import NO_RETRY, KVCoordClient, NotFoundError, UnavailableError
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.service.ownership import Member, owner_of
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from stopping import stop_process
from support import child_pids
from tcp_proxy import Proxy
from test_replicas import POOL_CONFIG, claims, placed_many

REPLICAS = ("r0", "r1", "r2")
LEASE = 3
BIG_LEASE = 10  # test_a_large_pools_base_...: its rebuild of 65,536 blocks holds the loop for seconds at load


def _config(
    endpoints: list[str],
    replica: str,
    data_dir: Path,
    cluster: str,
    journal: str,
    every: int,
    lease: float = LEASE,
) -> str:
    listed = ", ".join(f'"{e}"' for e in endpoints)
    return (
        f'[server]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\nlog_level = "INFO"\n'
        f"grace_seconds = 5.0\n"
        f'[cluster]\nendpoints = [{listed}]\nname = "{cluster}"\nreplica_id = "{replica}"\n'
        f'lease_seconds = {lease}\nstore_timeout_seconds = 1.0\njournal = "{journal}"\n'
        f"store_snapshot_records = {every}\n"
    )


def store_config(
    etcd: EtcdCluster | Etcd, replica: str, data_dir: Path, cluster: str, journal: str = "store"
) -> str:
    """A replica of the chaos run: a base snapshot every 40 records of a pool."""
    endpoints = etcd.endpoints if isinstance(etcd, EtcdCluster) else [etcd.endpoint]
    return _config(endpoints, replica, data_dir, cluster, journal, 40)


class Worker(threading.Thread):
    """Allocates 2-block requests in every pool, round robin, freeing the oldest when a
    pool holds 10. A call that fails has an unknown outcome: its request is left out
    of the exact check (it may or may not exist), but still counts for overlaps."""

    def __init__(self, targets: list[str], sessions: dict[str, tuple[str, object]]) -> None:
        super().__init__(daemon=True)
        self.targets = targets
        self.sessions = sessions
        self.acked: dict[str, dict[str, list[int]]] = {pool: {} for pool in sessions}
        self.unknown: set[str] = set()
        self.stop_now = threading.Event()
        self.calls = 0
        self.failures = 0
        self.serial = 0

    def run(self) -> None:
        client = KVCoordClient(list(self.targets), timeout=5.0)
        try:
            while not self.stop_now.is_set():
                for pool, (sid, fence) in self.sessions.items():
                    if self.stop_now.is_set():
                        break
                    held = self.acked[pool]
                    try:
                        if len(held) >= 10:
                            oldest = next(iter(held))
                            del held[oldest]
                            self.unknown.add(oldest)
                            client.free(pool, [oldest], session_id=sid, fence=fence)  # type: ignore[arg-type]
                            self.unknown.discard(oldest)
                        self.serial += 1
                        rid = f"q{self.serial}"
                        self.unknown.add(rid)
                        op = allocate(rid, list(range(self.serial, self.serial + 8)), 8).allocate
                        got = client.allocate(pool, op, sid, fence)  # type: ignore[arg-type]
                        self.unknown.discard(rid)
                        if not got.result.refused:
                            held[rid] = list(got.result.new_block_ids[0].block_ids)
                        self.calls += 1
                    except Exception:  # noqa: BLE001 - not acknowledged: unknown outcome
                        self.failures += 1
                        client.close()
                        time.sleep(0.2)
                        client = KVCoordClient(list(self.targets), timeout=5.0)
        finally:
            client.close()

    def finish(self) -> None:
        self.stop_now.set()
        self.join(120)
        assert not self.is_alive()


def listed(targets: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for t in targets:
        try:
            with KVCoordClient(t, timeout=2.0) as c:
                c.retry = c.retry.__class__(max_attempts=1)
                for p in c.list_pools().pools:
                    out[p.name] = p.replica
        except Exception:  # noqa: BLE001 - a replica down or cut off
            continue
    return out


def wait_served(targets: list[str], pools: list[str], timeout: float = 60.0) -> dict[str, str]:
    """Until every pool is served by exactly one live replica."""
    deadline = time.monotonic() + timeout
    got: dict[str, str] = {}
    while time.monotonic() < deadline:
        got = listed(targets)
        if set(got) == set(pools):
            return got
        time.sleep(0.2)
    raise AssertionError(f"pools not served after {timeout} s: {got}")


def check(targets: list[str], worker: Worker) -> None:
    """Every acknowledged allocation is present with its blocks; no block is held twice."""
    with KVCoordClient(targets, timeout=5.0) as c:
        for pool, held in worker.acked.items():
            view = c.inspect_pool(pool, all_requests=True)
            got = {r.request_id: list(r.groups[0].block_ids) for r in view.requests}
            for rid, blocks in held.items():
                assert got.get(rid) == blocks, f"{pool}: acknowledged {rid} {blocks}, found {got.get(rid)}"
            extra = set(got) - set(held) - worker.unknown
            assert not extra, f"{pool}: requests nobody was acknowledged: {sorted(extra)}"
            blocks = [b for ids in got.values() for b in ids]
            assert len(blocks) == len(set(blocks)), f"{pool}: a block held by two requests"


def create_and_attach(
    targets: list[str], pools: list[str], lease_seconds: int
) -> dict[str, tuple[str, object]]:
    """Create each pool and attach one session to it: pool -> (session id, fence)."""
    sessions: dict[str, tuple[str, object]] = {}
    with KVCoordClient(targets) as c:
        for pool in pools:
            c.create_pool(pool, POOL_CONFIG)
            s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=lease_seconds)
            sessions[pool] = (s.session_id, s.fence)
    return sessions


@pytest.mark.long
def test_pools_fail_over_without_loss_when_owners_and_store_members_die(
    etcd3: EtcdCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = request.node.name[:40]
    procs: dict[str, ServerProcess] = {}

    def start(replica: str) -> ServerProcess:
        procs[replica] = start_server(store_config(etcd3, replica, tmp_path / replica, cluster), env=env())
        return procs[replica]

    def addresses() -> list[str]:
        return [p.address for p in procs.values() if p.proc.poll() is None]

    try:
        for r in REPLICAS:
            start(r)
        # two pools placed on each replica
        pools = [p for r in REPLICAS for p in placed_many(f"f{r}-", r, list(REPLICAS), 2)]
        sessions = create_and_attach(addresses(), pools, 120)
        targets = addresses()
        worker = Worker(targets, sessions)
        worker.start()
        time.sleep(2.0)

        # 1. an owner dies (SIGKILL): its pools come back on the others, nothing lost
        victim = "r0"
        procs[victim].proc.kill()
        killed = time.monotonic()
        procs[victim].stop()
        rest = addresses()
        targets[:] = rest
        where = wait_served(rest, pools)
        print(
            f"every pool served again {time.monotonic() - killed:.1f} s after its owner died (lease {LEASE} s)"
        )
        assert victim not in where.values()
        time.sleep(2.0)
        before = worker.calls
        # 2. an etcd member dies while the client allocates (the quorum remains)
        etcd3.kill(0)
        time.sleep(3.0)
        # 3. the dead replica comes back: placement hands its pools back to it
        start(victim)
        targets[:] = addresses()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and victim not in listed(addresses()).values():
            time.sleep(0.3)
        assert victim in listed(addresses()).values()
        etcd3.restart(0)
        time.sleep(2.0)
        # 4. an owner is cut off from the store past its lease (SIGSTOP): the others
        # take its pools over; once it runs again, it answers nothing for them
        cut = "r1"
        stop_process(procs[cut].proc.pid)
        try:
            others = [procs[r].address for r in REPLICAS if r != cut]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if set(listed(others)) == set(pools):
                    break
                time.sleep(0.3)
            assert set(listed(others)) == set(pools)
            time.sleep(2.0)
        finally:
            os.kill(procs[cut].proc.pid, signal.SIGCONT)
        time.sleep(LEASE + 2.0)
        worker.finish()
        assert worker.calls > before > 0
        print(f"worker: {worker.calls} calls acknowledged, {worker.failures} failed (unknown outcome)")
        where = wait_served(addresses(), pools)
        check(addresses(), worker)
        logs = "".join(p.log() for p in procs.values())
        assert "took pool" in logs, "no pool was rebuilt from the store"
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                with_cont = p.proc.pid
                try:
                    os.kill(with_cont, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            p.stop()


def test_an_owner_cut_off_from_the_store_loses_its_pools_and_nothing_acknowledged(
    etcd3: EtcdCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """r0 reaches etcd only through a TCP proxy, which the test cuts past r0's lease
    while a client allocates and frees in every pool: r0 keeps running but stops
    serving (it commits nothing more: its writes are guarded by its term), the others
    take its pools over from the store; healed, r0 rejoins and gets its pools back
    by handover. Every acknowledged allocation is there; no block is held twice."""
    cluster = request.node.name[:40]
    proxy = Proxy(etcd3.endpoints[1])
    procs: dict[str, ServerProcess] = {}
    try:
        for r in REPLICAS:
            endpoints = [proxy.address] if r == "r0" else etcd3.endpoints
            procs[r] = start_server(_config(endpoints, r, tmp_path / r, cluster, "store", 40), env=env())
        pools = [p for r in REPLICAS for p in placed_many(f"f{r}-", r, list(REPLICAS), 2)]
        targets = [p.address for p in procs.values()]
        sessions = create_and_attach(targets, pools, 120)
        worker = Worker(targets, sessions)
        worker.start()
        time.sleep(2.0)
        proxy.cut()
        try:
            others = [procs["r1"].address, procs["r2"].address]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and set(listed(others)) != set(pools):
                time.sleep(0.3)
            assert set(listed(others)) == set(pools)
            assert not listed([procs["r0"].address]), "r0 still serves pools it cannot journal"
            time.sleep(2.0)
        finally:
            proxy.heal()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "r0" not in listed(targets).values():
            time.sleep(0.3)
        time.sleep(2.0)
        worker.finish()
        assert worker.calls > 0
        print(f"worker: {worker.calls} calls acknowledged, {worker.failures} failed (unknown outcome)")
        assert set(wait_served(targets, pools).values()) == set(REPLICAS)
        check(targets, worker)
    finally:
        for p in procs.values():
            p.stop()
        proxy.close()


@pytest.mark.long
def test_a_pool_rebuilt_from_the_store_has_the_ends_of_its_sessions(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Sessions that a replica got with a pool it rebuilt from the store, and that
    end there (one expires, its requests freed and their blocks handed to another
    session; one detaches), are ended in the pool's journal in the store too: when
    that replica dies in turn, the pool rebuilt again holds exactly what the live
    session was acknowledged (no freed block held twice, and the rebuild does not stop)."""
    cluster = request.node.name[:40]
    members = [Member(r, "") for r in ("r0", "r1")]
    pool = next(f"s{i}" for i in range(1000) if owner_of(f"s{i}", members).replica_id == "r0")  # type: ignore[union-attr]
    procs: dict[str, ServerProcess] = {}

    def start(r: str) -> str:
        procs[r] = start_server(_config([etcd.endpoint], r, tmp_path / r, cluster, "store", 1000), env=env())
        return procs[r].address

    def kill(r: str) -> None:
        procs[r].proc.kill()
        procs[r].stop()

    def wait_on(address: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pool not in listed([address]):
            time.sleep(0.2)
        assert pool in listed([address])

    try:
        a0, a1 = start("r0"), start("r1")
        with KVCoordClient([a0, a1], timeout=5.0) as c:
            c.create_pool(pool, POOL_CONFIG)
            short = c.attach(
                pool, "sha256_cbor", 4, "0", lease_seconds=12
            )  # (11.579 s at least: the 10 s stall bound)
            gone = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=60)
            live = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=60)
            first = c.allocate(pool, allocate("a", list(range(100, 100 + 4 * 60)), 4 * 60).allocate,
                               short.session_id, short.fence)  # fmt: skip
            assert not first.result.refused
            c.allocate(pool, allocate("d", [7, 7, 7, 7], 4).allocate, gone.session_id, gone.fence)
        kill("r0")  # r1 rebuilds the pool, its sessions with it
        wait_on(a1)
        acked = {}
        with KVCoordClient(a1, timeout=5.0) as c:
            c.detach(gone.session_id, gone.fence)
            deadline = time.monotonic() + 30  # the short session's lease ends on r1
            while time.monotonic() < deadline and c.inspect_pool(pool, all_requests=True).requests:
                time.sleep(0.2)
            assert not c.inspect_pool(pool, all_requests=True).requests
            for n in range(3):
                got = c.allocate(pool, allocate(f"b{n}", list(range(n * 1000, n * 1000 + 80)), 80).allocate,
                                 live.session_id, live.fence)  # fmt: skip
                assert not got.result.refused
                acked[f"b{n}"] = list(got.result.new_block_ids[0].block_ids)
        reused = set(first.result.new_block_ids[0].block_ids) & {b for ids in acked.values() for b in ids}
        assert reused, "the live session was given blocks the expired one held"
        kill("r1")  # r0 comes back and rebuilds the pool from the store
        a0 = start("r0")
        wait_on(a0)
        with KVCoordClient(a0, timeout=5.0) as c:
            view = c.inspect_pool(pool, all_requests=True)
            got = {r.request_id: list(r.groups[0].block_ids) for r in view.requests}
            assert got == acked
            # the rebuilt pool goes on: a new request gets blocks nobody holds
            more = c.allocate(pool, allocate("b3", list(range(5000, 5008)), 8).allocate,
                              live.session_id, live.fence)  # fmt: skip
            assert not more.result.refused
            held = {b for ids in acked.values() for b in ids}
            assert not held & set(more.result.new_block_ids[0].block_ids)
    finally:
        for p in procs.values():
            p.stop()


async def _damage_journal(etcd: Etcd, cluster: str, pool: str) -> int:
    """Overwrite every record of ``pool``'s journal in the store with bytes that are
    not CBOR (no replica can rebuild it); returns how many keys were overwritten."""
    import aetcd

    host, _, port = etcd.endpoint.rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as c:
        rows = await c.get_prefix(f"/kvcoord/{cluster}/journal/{pool}/".encode())
        for kv in rows:
            await c.put(kv.key, b"\x1c not cbor")
        return len(list(rows))


def test_a_pool_no_replica_can_serve_is_deleted_by_the_replica_placement_names(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """journal = "store": the owner dies and the pool's journal in the store cannot be
    rebuilt (damaged), so no replica serves the pool (the placed one tries again every
    lease). DeletePool through the replica set is a definite answer: the placed
    replica deletes the pool from the store (catalog and journal), then it is
    NOT_FOUND, and nobody tries to rebuild it any more."""
    import asyncio

    cluster = request.node.name[:40]
    members = [Member(r, "") for r in ("r0", "r1")]
    pool = next(f"z{i}" for i in range(1000) if owner_of(f"z{i}", members).replica_id == "r0")  # type: ignore[union-attr]
    procs: dict[str, ServerProcess] = {}
    for r in ("r0", "r1"):
        procs[r] = start_server(_config([etcd.endpoint], r, tmp_path / r, cluster, "store", 1000), env=env())
    targets = [procs["r0"].address, procs["r1"].address]
    try:
        with KVCoordClient(targets, timeout=5.0) as c:
            c.create_pool(pool, POOL_CONFIG)
            s = c.attach(pool, "sha256_cbor", 4, "0")
            assert not c.allocate(
                pool, allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence
            ).result.refused
        procs["r0"].proc.kill()  # its claim lasts LEASE seconds more: damaged before r1 may rebuild
        assert asyncio.run(_damage_journal(etcd, cluster, pool)) > 0
        deadline = time.monotonic() + 30
        while "cannot be rebuilt" not in procs["r1"].log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"pool {pool} cannot be rebuilt" in procs["r1"].log()
        with KVCoordClient(targets, timeout=5.0) as c:
            c.delete_pool(pool)
            tries = procs["r1"].log().count("cannot be rebuilt")
            with pytest.raises(NotFoundError):
                c.get_pool(pool)
        time.sleep(2 * LEASE)  # past the next try, had the pool stayed in the catalog
        assert procs["r1"].log().count("cannot be rebuilt") == tries
        assert pool not in claims(etcd, cluster)
    finally:
        for p in procs.values():
            p.stop()


def test_a_large_pools_base_in_the_store_is_encoded_off_the_loop_and_rebuilds_it(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """journal = "store": a base record of a pool that has built more than
    state_export.FORK_BLOCKS blocks is encoded by a forked child, the image of the
    pool right after the record that made it due. While that child is held (SIGSTOP),
    another pool is answered and the call whose record made the base due waits for
    it; then the replica is SIGKILLed and, restarted, rebuilds the pool from the store
    (that base and the records after it) with every acknowledged allocation."""
    cluster = request.node.name[:40]
    per_request = 16384  # blocks: four requests build 65,536 (> FORK_BLOCKS)
    big = pb.PoolConfig(
        num_blocks=4 * per_request + 64, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0",
        enable_caching=True, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
    )  # fmt: skip
    # term, attach and four allocations: 6 records; the base falls due at the 8th. The
    # lease outlasts the rebuild, which holds the loop: at a 6 % CPU quota (~ load 30 on 2
    # cores) it held it 4.6 s, past a 3 s lease; lost, claimed and rebuilt again, it was
    # never served in 2 minutes (at load 25-45: OwnerChangingError past the client's retries)
    text = _config([etcd.endpoint], "solo", tmp_path / "solo", cluster, "store", 8, BIG_LEASE)
    server = start_server(text, env=env())
    acked: dict[str, list[int]] = {}
    try:
        with KVCoordClient(server.address, timeout=60.0) as c:
            c.create_pool("big", big)
            c.create_pool("small", POOL_CONFIG)
            s = c.attach("big", "sha256_cbor", 4, "0", lease_seconds=600)

            def alloc(rid: str, tokens: list[int]) -> None:
                got = c.allocate("big", allocate(rid, tokens, len(tokens)).allocate, s.session_id, s.fence)
                assert not got.result.refused
                acked[rid] = list(got.result.new_block_ids[0].block_ids)

            for n in range(4):
                alloc(f"a{n}", list(range(n * 4 * per_request, (n + 1) * 4 * per_request)))
            assert child_pids(server.proc.pid) == []
            # small allocations, one at a time: the record of one of them makes the base
            # due, and that call waits for the base in the store
            due = threading.Thread(
                target=lambda: [alloc(f"b{n}", [n, n, n, n]) for n in range(8)], daemon=True
            )
            due.start()
            deadline = time.monotonic() + 30
            while (
                not (child := child_pids(server.proc.pid)) and due.is_alive() and time.monotonic() < deadline
            ):
                time.sleep(0.001)
            assert child, "no child encodes the base (it was encoded on the loop)"
            stop_process(child[0])
            try:
                with KVCoordClient(server.address, timeout=5.0, retry=NO_RETRY) as probe:
                    assert probe.get_pool("small").pool.name == "small"
                assert due.is_alive(), "the call that made the base due waits for it"
            finally:
                os.kill(child[0], signal.SIGCONT)
            due.join(60)
            assert not due.is_alive() and "b7" in acked
        server.proc.kill()
        server.stop()
        server = start_server(text, startup_timeout=60.0, env=env())
        # a bound, not a measure: on a loaded machine (2 cores, load 40; tests/cluster on 2
        # workers) 30 s ran out before the restarted replica served the pool again; and at
        # load 25-45 a pool listed was still answered "changing owner" past the client's
        # retries (OwnerChangingError: retry): it is asked until it answers, within the bound
        deadline = time.monotonic() + 120
        view = None
        while view is None and time.monotonic() < deadline:
            try:
                with KVCoordClient(server.address, timeout=30.0) as c:
                    view = c.inspect_pool("big", all_requests=True)
            except UnavailableError:  # OwnerChangingError among them
                time.sleep(0.2)
        assert view is not None, server.log()
        assert "took pool big over from the cluster store" in server.log()
        assert {r.request_id: list(r.groups[0].block_ids) for r in view.requests} == acked
    finally:
        server.stop()


def test_watchers_see_no_event_before_it_is_in_the_store(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A pool's KV events reach watchers only once their record is committed in the
    store as well as on disk: while etcd does not answer (stopped for less than the
    lease), an allocation's BlockStored events are not shown; once etcd answers, they
    are, and the allocation is acknowledged. (A watcher never sees an event the next
    owner, rebuilt from the store, would not have.)"""
    cluster = request.node.name[:40]
    server = start_server(_config([etcd.endpoint], "r0", tmp_path / "r0", cluster, "store", 1000), env=env())
    config = pb.PoolConfig()
    config.CopyFrom(POOL_CONFIG)
    config.enable_kv_cache_events = True
    seen: list[tuple[float, int]] = []
    try:
        with KVCoordClient(server.address, timeout=10.0) as c:
            c.create_pool("w", config)
            s = c.attach("w", "sha256_cbor", 4, "0", lease_seconds=60)

            def watch() -> None:
                with KVCoordClient(server.address, timeout=30.0) as w:
                    for message in w.watch_events("w", 0, timeout=8):
                        seen.append((time.monotonic(), message.sequence))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            c.allocate("w", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not seen:
                time.sleep(0.05)
            assert seen, "the watcher sees committed events"
            # every event of "a" in: the last committed one, read by a short second watch
            # (a quiet spell of the watcher is no proof: under load its events came 0.6 s apart)
            last = max(m.sequence for m in c.watch_events("w", 0, timeout=2))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and seen[-1][1] < last:
                time.sleep(0.05)
            assert seen[-1][1] == last
            before = len(seen)
            answered: list[float] = []

            def second() -> None:
                c.allocate("w", allocate("b", list(range(100, 108)), 8).allocate, s.session_id, s.fence)
                answered.append(time.monotonic())

            etcd.freeze()
            try:
                caller = threading.Thread(target=second, daemon=True)
                caller.start()
                time.sleep(1.5)
                assert len(seen) == before, "an event was shown before its record was in the store"
                assert not answered, "an allocation was acknowledged before its record was in the store"
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
                resumed = time.monotonic()
            caller.join(30)
            assert answered and answered[0] >= resumed
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(seen) == before:
                time.sleep(0.05)
            assert len(seen) > before and all(at >= resumed for at, _ in seen[before:])
            watcher.join(30)
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
        server.stop()
