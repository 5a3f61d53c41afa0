"""A seeded crash-point harness for the cluster (``journal = "store"``): three replica
processes, each reaching a real etcd through its own TCP proxy, and three workers
allocating and freeing over real gRPC in two pools (each worker a session per pool,
its client following the owners), while at seeded points: the owner of a pool is
SIGKILLed (another takes the pool over from the store), a replica that owns nothing
of the first pool is SIGKILLed, a replica stops with SIGTERM (its pools handed over),
a stopped replica starts again (the pools placement gives it handed back), an owner is
cut off from etcd past its lease (its proxy cut, then healed), or etcd is paused
(SIGSTOP, then SIGCONT). At every quiet point, once each worker has had answers since,
each pool's owner must hold exactly what its workers were told, block for block: no
acknowledged allocation lost unless its worker was told its session was gone (a typed
``FencedError`` / ``SessionExpiredError``), no block held by two requests, the pool
sound (CheckPool); at the end each worker frees what it holds and the pools are empty.

Longer hunts by hand: ``KVCOORD_CLUSTER_CRASH_SEEDS="1 2 ... 40"``,
``KVCOORD_CLUSTER_CRASH_ROUNDS=3`` (the events repeated),
``KVCOORD_CLUSTER_CRASH_EXTRA="cut pause"`` (more events)."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from durable_server import env, free_port
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import (
    FencedError,
    GracePeriodError,
    KVCoordError,
    OutcomeUnknownError,
    SessionExpiredError,
    UnavailableError,
)
from kvcoord.client.retry import DEFAULT_RETRY
from kvcoord.service.ownership import Member, owner_of
from kvcoord.v1 import allocator_pb2 as pb
from tcp_proxy import Proxy
from workload import check_pool

REPLICAS = ("r0", "r1", "r2")
NUM_BLOCKS = 48
LEASE = 2  # a replica's membership lease (s): a dead owner's pools are taken over after it
SESSION_LEASE = 60.0  # a worker's session outlives every event of a run
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
        self._log = open(self.tmp / f"server-{self.starts}.log", "wb")  # noqa: SIM115 - closed by kill/stop
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(self.config)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env(),
        )  # fmt: skip
        self.starts += 1
        deadline = time.monotonic() + timeout
        while "kvcoord serving gRPC on" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.replica} exited with {self.proc.returncode}: {self.log()}")
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.02)

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


class Worker(threading.Thread):
    """Allocates requests of 1-4 blocks (hashes unique to the request: no block is ever
    shared through the prefix cache) and frees them, one keyed Step each, in a pool
    chosen at random. ``acked[pool]``: request id -> the block ids its answer gave, for
    every allocation acknowledged and not freed since; ``unknown[pool]``: requests
    whose last call ended without an answer (held or not: freed ``if_held`` next)."""

    def __init__(
        self, targets: list[str], name: str, seed: int, gate: threading.Event, pools: list[str]
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.targets = targets
        self.pools = pools
        self.rnd = random.Random(seed)
        self.gate = gate
        self.idle = threading.Event()
        self.stop = False
        self.acked: dict[str, dict[str, list[int]]] = {p: {} for p in pools}
        self.unknown: dict[str, set[str]] = {p: set() for p in pools}
        self.sessions: dict[str, Any] = {p: None for p in pools}
        self.calls = 0  # calls answered (a result or a typed error)
        self.lost_told = 0  # times told a session was gone
        self.unknowns = 0  # calls that ended with no answer
        self.error = ""
        self.n = 0

    def run(self) -> None:
        try:
            with KVCoordClient(self.targets, retry=PATIENT, timeout=10) as c:
                while not self.stop:
                    if not self.gate.is_set():
                        self.idle.set()
                        self.gate.wait(0.05)
                        continue
                    self.idle.clear()
                    self._one(c)
        except BaseException as exc:  # reported by the test
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        finally:
            self.idle.set()

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
        except (OutcomeUnknownError, UnavailableError):  # (GracePeriodError too)
            self.unknowns += 1
            return None
        self.calls += 1
        session.fence.CopyFrom(answer.fence)
        result = answer.results[0]
        assert result.status_code == 0, result
        return result

    def _one(self, c: KVCoordClient) -> None:
        pool = self.rnd.choice(self.pools)
        if self.sessions[pool] is None:
            try:
                self.sessions[pool] = c.attach(
                    pool, "sha256_cbor", 4, "0", self.name, lease_seconds=SESSION_LEASE
                )
            except (GracePeriodError, UnavailableError, *LOST):
                return
        acked, unknown = self.acked[pool], self.unknown[pool]
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
            self.n += 1
            rid = f"{self.name}-{self.n}"
            tokens = 4 * self.rnd.randint(1, 4)
            sync = pb.RequestSync(
                request_id=rid, append_token_ids=list(range(tokens)), new_request=True,
                append_block_hashes=[f"{rid}/{i}".encode().ljust(32, b".") for i in range(tokens // 4)],
            )  # fmt: skip
            op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=tokens))
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
        start = [w.calls for w in self.workers]
        self.gate.set()
        deadline = time.monotonic() + 120
        while any(
            w.calls < s + min_calls and w.is_alive() and not w.error
            for w, s in zip(self.workers, start, strict=True)
        ):
            assert time.monotonic() < deadline, f"a worker made no progress\n{self.logs()}"
            time.sleep(0.01)
        self.gate.clear()
        for w in self.workers:
            assert w.idle.wait(120), f"{w.name} never stopped"
            assert not w.error, f"{w.name}: {w.error}\n{self.logs()}"

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
            missing = {r: (ids, held.get(r)) for r, ids in acked.items() if held.get(r) != ids}
            extra = {r: ids for r, ids in held.items() if r not in acked and r not in unknown}
            assert not missing and not extra, (
                f"{done}: {pool}: acked but not held as told (acked, held): {missing}; "
                f"held unacked: {extra}\n{self.logs()}"
            )
            blocks = [b for ids in held.values() for b in ids]
            assert len(blocks) == len(set(blocks)), f"{done}: {pool}: a block held twice: {held}"
            check_pool(c, pool, NUM_BLOCKS)
            assert not c.check_pool(pool).violations
        self.checks += 1

    def down(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.up]

    def restart_down(self) -> str:
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

    def pause_etcd(self) -> str:
        """etcd SIGSTOPped a while (every replica cut off at once), then SIGCONT."""
        self.run_a_moment()
        held = self.rnd.uniform(0.2, 1.5) * LEASE
        os.kill(self.etcd.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(held)
        finally:
            os.kill(self.etcd.proc.pid, signal.SIGCONT)
        return f"pause-etcd@{held:.1f}"


SEEDS = [int(x) for x in os.environ.get("KVCOORD_CLUSTER_CRASH_SEEDS", "1 2").split()]


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
    rnd.shuffle(events)
    events *= int(os.environ.get("KVCOORD_CLUSTER_CRASH_ROUNDS", "1"))
    done: list[str] = []
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
                if event in ("kill-owner", "kill-replica", "handover") and h.down():
                    done.append(h.restart_down())  # one replica down at a time
                    h.quiesce(2)
                    h.check(c, done)
                if event == "kill-owner":
                    done.append(h.kill_owner())
                elif event == "kill-replica":
                    done.append(h.kill_replica())
                elif event == "handover":
                    done.append(h.handover())
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
    calls = sum(w.calls for w in h.workers)
    print(f"seed {seed}: store_snapshot_records {h.every}, {done}, {h.checks} checks, {calls} calls, "
          f"{unknowns} unanswered")  # fmt: skip
