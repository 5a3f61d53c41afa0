"""A seeded crash-point harness for the cluster (``journal = "store"``): three replica
processes, each reaching a real etcd through its own TCP proxy, and three workers
allocating and freeing over real gRPC in two pools (each worker a session per pool,
its client following the owners; now and then a worker ends a session and begins
another), while at seeded points: the owner of a pool is SIGKILLed (another takes
the pool over from the store), a replica that owns neither pool is SIGKILLed, an
owner stops with SIGTERM (its pools handed over), or is SIGKILLed a moment into that,
or is SIGKILLed and started again at once (its claim not lapsed yet), or is SIGKILLed
and then so is the replica taking its pool over; an owner is SIGSTOPped past its lease
(its pools taken over under it), cut off from etcd past it (its proxy cut, then
healed) or deaf to etcd a while (its writes made, their answers dropped); etcd is
paused (SIGSTOP, then SIGCONT). A replica down is started again before the next
event that takes one down (the pools placement gives it handed back). At every quiet
point, once each worker has had answers since, each pool's owner must hold exactly
what its workers were told, block for block: no acknowledged allocation lost unless
its worker was told its session was gone (a typed ``FencedError`` /
``SessionExpiredError``: never expected here, every session outlives the run), no
block held by two requests, the pool sound (CheckPool); at the end each worker frees
what it holds and the pools are empty. A call that ended unanswered (its outcome
unknown) is given back with ``if_held`` at its worker's next call.

Longer hunts by hand: ``KVCOORD_CLUSTER_CRASH_SEEDS="1 2 ... 40"``,
``KVCOORD_CLUSTER_CRASH_ROUNDS=3`` (the events repeated),
``KVCOORD_CLUSTER_CRASH_EXTRA="freeze deafen term-kill bounce kill-taker"`` (more
events; by default each seed runs the five core events and one of these),
``KVCOORD_CLUSTER_CRASH_EVENTS="deafen freeze"`` (these events only)."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from crash_workers import GatedWorker, quiesce, told_against_held
from durable_server import env, free_port
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import (
    FencedError,
    KVCoordError,
    NotOwnerError,
    OutcomeUnknownError,
    SessionExpiredError,
    UnavailableError,
)
from kvcoord.client.retry import DEFAULT_RETRY
from kvcoord.service.ownership import Member, owner_of
from kvcoord.v1 import allocator_pb2 as pb
from stopping import stop_process
from tcp_proxy import Proxy
from workload import check_pool

REPLICAS = ("r0", "r1", "r2")
NUM_BLOCKS = 48
LEASE = 2  # a replica's membership lease (s): a dead owner's pools are taken over after it
SESSION_LEASE = 60.0  # a worker's session outlives every event of a run
START_TRIES = 5  # starts of a replica whose store did not answer in time (exit 3), as a supervisor's
RESTART_PAUSE = 1.0  # seconds between those starts
#: what such a start logs (the store did not answer the connection, or a call while joining)
STORE_LATE = ("no cluster store endpoint answers", "the cluster store failed while this replica joined")
#: keyed Steps retried across a failover (several seconds on a loaded machine)
PATIENT = dataclasses.replace(DEFAULT_RETRY, initial_backoff=0.02, max_backoff=0.3, keyed_deadline=60.0)
#: errors that tell a worker its session, and so its requests, are gone
LOST = (FencedError, SessionExpiredError)
POOL_CONFIG = pb.PoolConfig(
    num_blocks=NUM_BLOCKS, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
    groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
)  # fmt: skip


class Node:
    """One replica, ``kvcoord serve`` on a fixed port (a restart keeps its address),
    its data directory kept across restarts, etcd reached through :attr:`proxy`."""

    def __init__(self, tmp: Path, replica: str, etcd: Etcd, cluster: str, every: int) -> None:
        self.tmp = tmp / replica
        self.tmp.mkdir()
        self.replica = replica
        self.proxy = Proxy(etcd.endpoint)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = self.tmp / "kvcoord.toml"
        self.config.write_text(
            f'[server]\nlisten = ["{self.address}"]\nmetrics_listen = ""\n'
            f'data_dir = "{self.tmp / "data"}"\nsynchronous = "NORMAL"\nlog_level = "INFO"\n'
            f"grace_seconds = 5.0\n"
            f'[cluster]\nendpoints = ["{self.proxy.address}"]\nname = "{cluster}"\n'
            f'replica_id = "{replica}"\nlease_seconds = {LEASE}\nstore_timeout_seconds = 1.0\n'
            f'journal = "store"\nstore_snapshot_records = {every}\n'
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: Any = None

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> None:
        """Start the replica; one that exits 3 because its store did not answer within its
        store timeout (connecting, or a call while joining) is started again, as the
        deploy's supervisor does (``restart: unless-stopped``), at most
        :data:`START_TRIES` times in all (was: the run failed at once: etcd, behind the
        proxy, took over 1 s to answer at load 25-45)."""
        for _ in range(START_TRIES - 1):
            if self._start(timeout):
                return
            self._log.close()
            time.sleep(RESTART_PAUSE)
        assert self._start(timeout), self.logs()

    def _start(self, timeout: float) -> bool:
        """True once serving; False when it exited because its store did not answer."""
        self._log = open(self.tmp / f"server-{self.starts}.log", "wb")  # noqa: SIM115 - closed by kill/stop
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(self.config)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env(),
        )  # fmt: skip
        self.starts += 1
        deadline = time.monotonic() + timeout
        while "kvcoord serving gRPC on" not in self.log():
            if self.proc.poll() is not None:
                if self.proc.returncode == 3 and any(why in self.log() for why in STORE_LATE):
                    return False
                raise RuntimeError(f"{self.replica} exited with {self.proc.returncode}: {self.log()}")
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.02)
        return True

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def stop(self) -> int | None:
        """SIGTERM (its pools handed over), then wait; SIGKILL if it does not end."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        return (self.tmp / f"server-{self.starts - 1}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "".join(
            f"--- {self.replica} start {n}\n" + (self.tmp / f"server-{n}.log").read_text(errors="replace")
            for n in range(self.starts)
        )


class Worker(GatedWorker):
    """Allocates requests of 1-4 blocks and frees them, one keyed Step each, in a pool
    chosen at random. ``acked[pool]``: request id -> the block ids its answer gave, for
    every allocation acknowledged and not freed since; ``unknown[pool]``: requests whose
    last call ended without an answer (held or not: freed ``if_held`` next)."""

    def __init__(
        self, targets: list[str], name: str, seed: int, gate: threading.Event, pools: list[str]
    ) -> None:
        super().__init__(name, seed, gate)
        self.targets = targets
        self.pools = pools
        self.acked: dict[str, dict[str, list[int]]] = {p: {} for p in pools}
        self.unknown: dict[str, set[str]] = {p: set() for p in pools}
        self.sessions: dict[str, Any] = {p: None for p in pools}
        #: pool -> request -> its last answer: when, by which owner
        self.told: dict[str, dict[str, str]] = {p: {} for p in pools}
        self.unknowns = 0  # calls that ended with no answer
        self.redirects = 0  # Detaches sent again (unanswered, or NOT_OWNER: nothing applied)

    def connect(self) -> KVCoordClient:
        return KVCoordClient(self.targets, retry=PATIENT, timeout=10)

    def _step(self, c: KVCoordClient, pool: str, op: pb.Operation) -> pb.OperationResult | None:
        """One keyed Step: its result, or None when the worker was told its session is
        gone (its requests forgotten) or the call ended without an answer."""
        session = self.sessions[pool]
        try:
            answer = c.step(pool, [op], session.session_id, session.fence)
        except LOST:
            self.calls += 1
            self.lost_told += 1
            self.acked[pool].clear()
            self.unknown[pool].clear()
            self.sessions[pool] = None
            return None
        except (OutcomeUnknownError, UnavailableError, NotOwnerError):  # (GracePeriodError too)
            self.unknowns += 1
            return None
        self.calls += 1
        session.fence.CopyFrom(answer.fence)
        f = answer.fence  # (what a failing check shows of the answer)
        rid = op.free.request_id or op.allocate.request.request_id
        self.told[pool][rid] = (
            f"{op.WhichOneof('op')} {time.strftime('%X')} term {f.term} {f.instance_id[:8]}"
        )
        result = answer.results[0]
        assert result.status_code == 0, result
        return result

    def _detach(self, c: KVCoordClient, pool: str) -> None:
        """End the pool's session. A Detach carries no retry key: one whose answer was
        lost is sent again until the owner says the session is gone."""
        session = self.sessions[pool]
        for _ in range(1200):
            try:
                c.detach(session.session_id, session.fence)
                break
            except LOST:
                break
            except (OutcomeUnknownError, UnavailableError, NotOwnerError):
                # (NOT_OWNER naming an owner the client saw down: an unkeyed call is
                # not sent there, the caller is told; it applied nothing)
                self.redirects += 1
                time.sleep(0.05)
        else:
            raise AssertionError("no owner ever answered a Detach")
        self.calls += 1
        self.acked[pool].clear()
        self.unknown[pool].clear()
        self.sessions[pool] = None

    def one(self, c: KVCoordClient) -> None:
        pool = self.rnd.choice(self.pools)
        if self.sessions[pool] is None:
            try:
                self.sessions[pool] = c.attach(
                    pool, "sha256_cbor", 4, "0", self.name, lease_seconds=SESSION_LEASE
                )
            except (UnavailableError, NotOwnerError, *LOST):  # (an Attach settles ~1 s only)
                return
        acked, unknown = self.acked[pool], self.unknown[pool]
        if self.rnd.random() < 0.03:  # the worker restarts: its session ends, a new one begins
            self._detach(c, pool)
            return
        if unknown:  # a call that ended unanswered: its request given back if it is held
            rid = min(unknown)
            if self._step(c, pool, pb.Operation(free=pb.FreeOp(request_id=rid, if_held=True))) is not None:
                unknown.discard(rid)
            return
        free = acked and (len(acked) >= 5 or self.rnd.random() < 0.4)
        if free:
            rid = self.rnd.choice(sorted(acked))
            op = pb.Operation(free=pb.FreeOp(request_id=rid))
        else:
            rid, op = self.new_allocation()
        result = self._step(c, pool, op)
        if result is None:
            if self.sessions[pool] is not None:  # unanswered (not told its session is gone)
                acked.pop(rid, None)
                unknown.add(rid)
            return
        if free:
            del acked[rid]
        elif result.allocate.refused:
            unknown.add(rid)  # registered, no blocks: given back at the next call
        else:
            acked[rid] = list(result.allocate.new_block_ids[0].block_ids)


class Harness:
    def __init__(self, tmp: Path, etcd: Etcd, cluster: str, seed: int) -> None:
        self.rnd = random.Random(seed)
        every = self.rnd.choice([3, 10, 1000])
        self.every = every
        self.nodes = {r: Node(tmp, r, etcd, cluster, every) for r in REPLICAS}
        self.etcd = etcd
        self.cluster = cluster
        members = [Member(r, "") for r in REPLICAS]
        # one pool placed on each of two replicas
        self.pools = [
            next(f"{r}p{n}" for n in range(1000) if owner_of(f"{r}p{n}", members).replica_id == r)  # type: ignore[union-attr]
            for r in ("r0", "r1")
        ]
        self.targets = [n.address for n in self.nodes.values()]
        self.gate = threading.Event()
        self.workers = [Worker(self.targets, f"w{i}", seed * 10 + i, self.gate, self.pools) for i in range(3)]
        self.checks = 0
        self.done: list[str] = []  # the events so far

    def logs(self) -> str:
        return "".join(n.logs() for n in self.nodes.values())

    def owners(self) -> dict[str, str]:
        """pool -> the replica serving it now (asked of every live replica)."""
        out: dict[str, str] = {}
        for n in self.nodes.values():
            if not n.up:
                continue
            try:
                with KVCoordClient(n.address, timeout=2.0) as c:
                    c.retry = c.retry.__class__(max_attempts=1)
                    for p in c.list_pools().pools:
                        out[p.name] = p.replica
            except KVCoordError:
                continue
        return out

    def wait_served(self, timeout: float = 90.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        got: dict[str, str] = {}
        while time.monotonic() < deadline:
            got = self.owners()
            if set(got) == set(self.pools):
                return got
            time.sleep(0.2)
        raise AssertionError(f"pools not served after {timeout} s: {got}\n{self.logs()}")

    def quiesce(self, min_calls: int = 1) -> None:
        quiesce(self.workers, self.gate, min_calls, 120, lambda: f"{self.done}\n{self.logs()}")

    def check(self, c: KVCoordClient, done: list[str]) -> None:
        """Quiet: each pool's owner holds exactly the workers' acknowledged allocations
        (a request whose call went unanswered may be held or not, never on a block
        another holds)."""
        self.wait_served()
        for pool in self.pools:
            acked: dict[str, list[int]] = {}
            unknown: set[str] = set()
            for w in self.workers:
                acked.update(w.acked[pool])
                unknown |= w.unknown[pool]
            held = {
                r.request_id: list(r.groups[0].block_ids)
                for r in c.inspect_pool(pool, all_requests=True).requests
            }
            missing, extra, twice = told_against_held(acked, held, unknown)
            assert not missing and not extra, (
                f"{done}: {pool}: acked but not held as told (acked, held): {missing}; "
                f"held unacked: {extra}\n{self.logs()}\nthe store: {self.store_keys(pool)}\n"
                f"their last answers: {[w.told[pool].get(r) for w in self.workers for r in [*missing, *extra]]}"
            )
            assert not twice, f"{done}: {pool}: blocks {twice} held twice: {held}"
            check_pool(c, pool, NUM_BLOCKS)
            assert not c.check_pool(pool).violations
        self.checks += 1

    def store_keys(self, pool: str) -> str:
        """The pool's claim and journal keys in etcd (what a failing check shows)."""
        import asyncio

        async def read() -> str:
            import aetcd

            host, _, port = self.etcd.endpoint.rpartition(":")
            prefix = f"/kvcoord/{self.cluster}/".encode()
            async with aetcd.Client(host=host, port=int(port), timeout=5) as c:
                owner = await c.get(prefix + b"owners/" + pool.encode())
                rows = await c.get_prefix(prefix + b"journal/" + pool.encode() + b"/")
                keys = [
                    f"{kv.key[len(prefix) :].decode()} rev {kv.mod_revision} ({len(kv.value)} B)"
                    for kv in rows
                ]
            claim = None if owner is None else (owner.value, owner.mod_revision)
            return f"claim {claim}\n" + "\n".join(keys)

        try:
            return asyncio.run(read())
        except Exception as exc:  # noqa: BLE001 - forensics only
            return repr(exc)

    def down(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.up]

    def restart_down(self) -> str:
        """Start the replicas that are down while the workers run: placement hands them
        their pools back."""
        self.gate.set()
        names = []
        for n in self.down():
            n.start()
            names.append(n.replica)
        return f"restart:{','.join(names)}"

    def run_a_moment(self) -> None:
        self.gate.set()
        time.sleep(self.rnd.uniform(0.0, 0.5))

    def kill_owner(self) -> str:
        """SIGKILL the owner of a pool at a random moment: another takes it over."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        self.nodes[victim].kill()
        return f"kill-owner:{victim}({pool})"

    def kill_replica(self) -> str:
        """SIGKILL a replica serving neither pool if there is one (else the first pool's
        non-owner): its death moves nothing of these pools, unless placement hands
        them to it when it is back."""
        owners = self.wait_served()
        live = [r for r, n in self.nodes.items() if n.up]
        idle = [r for r in live if r not in owners.values()] or [
            r for r in live if r != owners[self.pools[0]]
        ]
        victim = self.rnd.choice(idle)
        self.run_a_moment()
        self.nodes[victim].kill()
        return f"kill-replica:{victim}"

    def handover(self) -> str:
        """SIGTERM the owner of a pool while the workers run: it hands its pools over."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        code = self.nodes[victim].stop()
        assert code == 0, f"{victim} stopped with {code}\n{self.nodes[victim].log()}"
        return f"handover:{victim}({pool})"

    def term_then_kill(self) -> str:
        """SIGTERM the owner of a pool (its handovers begin), SIGKILLed a moment later."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        node = self.nodes[victim]
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        delay = self.rnd.uniform(0.0, 1.0)
        time.sleep(delay)
        node.kill()
        return f"term+{delay:.2f}:{victim}({pool})"

    def bounce(self) -> str:
        """SIGKILL the owner of a pool and start it again at once (its claim's lease has
        not run out: it rejoins while its old self still holds the pool in etcd)."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        node = self.nodes[victim]
        node.kill()
        time.sleep(self.rnd.uniform(0.0, LEASE))
        node.start()
        return f"bounce:{victim}({pool})"

    def kill_taker(self) -> str:
        """SIGKILL the owner of a pool, then, a seeded moment into the takeover, the
        replica that took (or is taking) it over: one replica is left."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        self.nodes[victim].kill()
        members = [Member(r, "") for r, n in self.nodes.items() if n.up]
        taker = owner_of(pool, members).replica_id  # type: ignore[union-attr]
        delay = self.rnd.uniform(0.5, 2.0) * LEASE
        time.sleep(delay)
        self.nodes[taker].kill()
        return f"kill-taker:{victim},{taker}({pool})@{delay:.1f}"

    def cut(self) -> str:
        """Cut an owner off from etcd past its lease while the workers run, then heal:
        the others take its pools over; it serves them no more."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        node = self.nodes[victim]
        node.proxy.cut()
        held = self.rnd.uniform(0.5, 2.5) * LEASE
        time.sleep(held)
        node.proxy.heal()
        return f"cut:{victim}({pool})@{held:.1f}"

    def freeze(self) -> str:
        """SIGSTOP the owner of a pool past its lease while the workers run (the others
        take its pools over), then SIGCONT: it must acknowledge nothing more of them."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        node = self.nodes[victim]
        assert node.proc is not None
        held = self.rnd.uniform(0.5, 3.0) * LEASE
        stop_process(node.proc.pid)
        try:
            time.sleep(held)
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        return f"freeze:{victim}({pool})@{held:.1f}"

    def deafen(self) -> str:
        """etcd's answers to the owner of a pool dropped a while (its writes are made,
        it is not told), then its connections cut and healed."""
        pool = self.rnd.choice(self.pools)
        victim = self.wait_served()[pool]
        self.run_a_moment()
        proxy = self.nodes[victim].proxy
        held = self.rnd.uniform(0.2, 2.5) * LEASE
        proxy.deafen()
        time.sleep(held)
        proxy.cut()
        proxy.hear()
        proxy.heal()
        return f"deafen:{victim}({pool})@{held:.1f}"

    def pause_etcd(self) -> str:
        """etcd SIGSTOPped a while (every replica cut off at once), then SIGCONT."""
        self.run_a_moment()
        held = self.rnd.uniform(0.2, 1.5) * LEASE
        self.etcd.freeze()
        try:
            time.sleep(held)
        finally:
            os.kill(self.etcd.proc.pid, signal.SIGCONT)
        return f"pause-etcd@{held:.1f}"


#: events that take a replica down (one at a time: the others restarted first)
KILLS = ("kill-owner", "kill-replica", "handover", "term-kill", "bounce", "kill-taker")
SEEDS = [int(x) for x in os.environ.get("KVCOORD_CLUSTER_CRASH_SEEDS", "1 2").split()]


@pytest.mark.long
@pytest.mark.timeout(400)
@pytest.mark.parametrize("seed", SEEDS)
def test_cluster_crash_points_lose_no_acknowledged_block(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, seed: int
) -> None:
    rnd = random.Random(seed)
    cluster = f"crash{seed}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    h = Harness(tmp_path, etcd, cluster, seed)
    extra = os.environ.get("KVCOORD_CLUSTER_CRASH_EXTRA", "")
    events = ["kill-owner", "kill-replica", "handover", "cut", "pause", *extra.split()]
    events.append(rnd.choice(["term-kill", "bounce", "kill-taker", "freeze", "deafen"]))
    events = os.environ.get("KVCOORD_CLUSTER_CRASH_EVENTS", "").split() or events  # (these only)
    rnd.shuffle(events)
    events *= int(os.environ.get("KVCOORD_CLUSTER_CRASH_ROUNDS", "1"))
    done = h.done
    try:
        for n in h.nodes.values():
            n.start()
        with KVCoordClient(h.targets, timeout=10) as c:
            for pool in h.pools:
                c.create_pool(pool, POOL_CONFIG)
            for w in h.workers:
                w.start()
            h.quiesce(3)
            h.check(c, done)
            for event in events:
                if event in KILLS and h.down():
                    done.append(h.restart_down())  # one replica down at a time
                    h.quiesce(2)
                    h.check(c, done)
                if event == "kill-owner":
                    done.append(h.kill_owner())
                elif event == "kill-replica":
                    done.append(h.kill_replica())
                elif event == "handover":
                    done.append(h.handover())
                elif event == "term-kill":
                    done.append(h.term_then_kill())
                elif event == "bounce":
                    done.append(h.bounce())
                elif event == "kill-taker":
                    done.append(h.kill_taker())
                elif event == "freeze":
                    done.append(h.freeze())
                elif event == "deafen":
                    done.append(h.deafen())
                elif event == "cut":
                    done.append(h.cut())
                elif event == "pause":
                    done.append(h.pause_etcd())
                else:
                    raise AssertionError(f"no event {event}")
                h.quiesce(2)
                h.check(c, done)
                for w in h.workers:
                    assert not w.lost_told, f"{done}: {w.name} was told a session ended\n{h.logs()}"
            if h.down():
                done.append(h.restart_down())
                h.quiesce(2)
                h.check(c, done)
            # every worker frees what it holds from its own sessions; then the pools are empty
            h.gate.clear()
            for w in h.workers:
                w.stop = True
                w.join(120)
                assert not w.error, w.error
            for w in h.workers:
                for pool in h.pools:
                    s = w.sessions[pool]
                    for rid in sorted(w.unknown[pool]):
                        c.step(pool, [pb.Operation(free=pb.FreeOp(request_id=rid, if_held=True))],
                               s.session_id, s.fence)  # fmt: skip
                    for rid in sorted(w.acked[pool]):
                        c.step(pool, [pb.Operation(free=pb.FreeOp(request_id=rid))], s.session_id, s.fence)
            for pool in h.pools:
                stats = c.get_stats(pool)
                assert stats.num_requests == 0 and stats.num_free_blocks == NUM_BLOCKS - 1, stats
                check_pool(c, pool, NUM_BLOCKS)
    finally:
        h.gate.set()
        for w in h.workers:
            w.stop = True
        for n in h.nodes.values():
            if n.proc is not None:
                n.stop()
            n.proxy.close()
    unknowns = sum(w.unknowns for w in h.workers)
    redirects = sum(w.redirects for w in h.workers)
    calls = sum(w.calls for w in h.workers)
    print(f"seed {seed}: store_snapshot_records {h.every}, {done}, {h.checks} checks, {calls} calls, "
          f"{unknowns} unanswered, {redirects} Detaches sent again")  # fmt: skip
