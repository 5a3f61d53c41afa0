"""Many workers on ONE shared (non-exclusive) pool, with faults where they happen.

test_faults.py gives each worker its own pool (so each can be compared with an
in-process engine); here the workers share one, hit each other's prefixes and evict
each other's cached blocks, which is where a block handed to two owners or a hit on
rewritten KV would show:

* answers lost, late, duplicated and re-delivered on the wire: after every step each
  worker's own record of its requests' block tables equals the server's; every prefix
  hit reads blocks whose (modelled) KV is the prefix it was promised; no block is held
  twice except through the prefix cache, and free + held = capacity, checked while
  the workers run;
* worker processes SIGKILLed with calls in flight (short leases), new ones starting:
  the pool's invariants hold throughout, and once every lease has run out the pool
  holds nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from durable_server import DurableServer
from durable_workload import PATIENT
from kvcoord.client import KVCoordClient
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer
from shared_workers import (
    NUM_BLOCKS,
    KVMemory,
    routed_by_reservations,
    run_beside,
    shared_config,
    shared_worker,
)
from workload import check_pool, pool_config, run_worker


@pytest.fixture
def server() -> Iterator[InProcessServer]:
    s = InProcessServer("").start()
    yield s
    s.stop()


def test_workers_sharing_a_pool_on_a_faulty_network_keep_their_blocks(server: InProcessServer) -> None:
    """Four workers, 150 steps each, on one pool, 5% of answers dropped, late,
    duplicated and re-delivered: every worker's tables equal the server's after each
    step, every hit reads the KV it was promised, the pool's ownership holds while they
    run (evicted blocks may be shared without a hash), and nothing is lost or left."""
    memory = KVMemory()
    counts: dict[str, int] = dict.fromkeys(
        ("steps", "hits", "refusals", "preemptions", "evictions", "lost"), 0
    )
    injectors: list[FaultInjector] = []
    stop = threading.Event()
    samples: list[int] = []
    violations: list[str] = []
    with KVCoordClient(server.address) as c:
        c.create_pool("shared", shared_config())

        def sample() -> None:
            while not stop.is_set() and len(samples) < 100_000:
                try:
                    check_pool(c, "shared", NUM_BLOCKS)
                except AssertionError as exc:
                    if "not a prefix-cache block" not in str(exc):  # (evict_blocks drops hashes)
                        violations.append(str(exc))
                samples.append(1)
                stop.wait(0.005)

        run_beside(
            lambda w: shared_worker(server.address, "shared", w, 150, memory, counts, injectors),
            4,
            sample,
            stop,
        )
        assert not violations, violations[:3]
        final = c.get_stats("shared")
    faults = {k: sum(fi.counts[k] for fi in injectors) for k in injectors[0].counts}
    print(f"shared pool under faults: {counts} faults {faults} samples {len(samples)}")
    assert counts["steps"] == 4 * 150 and counts["lost"] == 0
    assert counts["hits"] > 50 and counts["refusals"] > 0 and counts["preemptions"] > 0
    assert faults["dropped"] > 20 and faults["duplicated"] > 20 and faults["reordered"] > 5
    assert final.num_requests == 0 and final.num_free_blocks == NUM_BLOCKS - 1


def test_sigkilled_workers_on_a_shared_pool_leave_nothing_held() -> None:
    """Worker processes on one pool (1 s leases) SIGKILLed one at a time, 12 times, with
    their calls in flight, new ones started in their place: the pool's ownership holds
    after every kill, and once the leases have run out and the last sessions ended,
    every block is free and CheckPool finds nothing."""
    num_blocks = 120
    server = InProcessServer(
        "", session_lease_seconds=1.0, max_session_lease_seconds=2.0, idempotency_window_seconds=10.0
    ).start()
    rnd = random.Random(3)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs: list[Any] = []
    try:
        with KVCoordClient(server.address, timeout=20) as c:
            c.create_pool("p", pool_config(num_blocks))
            wid = 0
            for _ in range(12):
                while sum(p.is_alive() for p in procs) < 3:
                    p = ctx.Process(target=run_worker, args=(server.address, "p", wid, 700 + wid, 400, out))
                    p.start()
                    procs.append(p)
                    wid += 1
                time.sleep(rnd.uniform(0.5, 1.5))
                victim = rnd.choice([p for p in procs if p.is_alive()])
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(10)
                check_pool(c, "p", num_blocks)
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join(10)
            # every lease (at most 2 s) runs out after the last kill, on the server's lease
            # clock (it leaves out gaps of more than 0.5 s in which the server did not run:
            # a fixed 2.5 s of sleep could end before it on a loaded machine)
            _reaped_until_none(server, c, "p")
            check_pool(c, "p", num_blocks)
            stats = c.get_stats("p")
            assert c.check_pool("p").violations == []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()
    assert stats.num_requests == 0 and stats.num_free_blocks == num_blocks - 1, stats


def _reaped_until_none(server: InProcessServer, c: KVCoordClient, pool: str) -> None:
    """Reap ``pool``'s expired sessions until none is left: every one's lease runs out
    on the server's lease clock, which leaves out any gap of more than 0.5 s in which
    the server did not run (lease_clock.py), so on a loaded machine later than a fixed
    sleep past the longest lease. The bound is on a hang only."""
    deadline = time.monotonic() + 120
    while True:
        server.call(server.running.servicer.reap_expired_sessions)  # type: ignore[union-attr]
        left = c.list_sessions(pool).sessions
        if not left:
            return
        assert time.monotonic() < deadline, f"sessions never ran out: {left}"
        time.sleep(0.05)


ROOT, ALICE, BOB = "tok-root", "tok-alice", "tok-bob"
TENANTS = f"""
[server]
auth_tokens = ["{ROOT}"]

[tenants.alice]
tokens = ["{ALICE}"]
grants = [{{ pools = ["shared"], roles = ["use", "observe", "administer"] }}]

[tenants.bob]
tokens = ["{BOB}"]
grants = [{{ pools = ["shared"], roles = ["use", "observe", "administer"] }}]
"""


def test_two_tenants_routers_reserving_on_a_faulty_network_never_hit_wrong_kv() -> None:
    """Four workers of two tenants on one pool (the same prompts, unsalted: only the
    tenants' cache namespaces keep them apart), each request routed first by a router of
    its tenant that reserves its hit (ScorePools, 0.05-1.5 s) on a channel that loses,
    duplicates and re-delivers answers, the workers' own answers lost, late, duplicated
    and re-delivered: every hit reads KV its own tenant wrote for that prefix, every
    worker's tables equal the server's after each step, CheckPool finds nothing while
    they run, and once the reservations ran out the pool holds nothing."""
    server = InProcessServer(TENANTS).start()
    memory = KVMemory()
    counts: dict[str, int] = dict.fromkeys(
        ("steps", "hits", "refusals", "preemptions", "evictions", "lost", "routed"), 0
    )
    injectors: list[FaultInjector] = []
    routers: list[FaultInjector] = []
    stop = threading.Event()
    samples: list[int] = []
    violations: list[str] = []

    def expire() -> int:
        return server.running.servicer.expire_reservations()  # type: ignore[union-attr]

    def worker(wid: int) -> None:
        token, tenant = (ALICE, "alice") if wid % 2 == 0 else (BOB, "bob")
        with routed_by_reservations(server.address, wid, counts, routers, token) as route:
            shared_worker(
                server.address, "shared", wid, 150, memory, counts, injectors, tenant, token, ROOT, route
            )

    try:
        with KVCoordClient(server.address, token=ROOT) as c:
            c.create_pool("shared", shared_config())

            def sample() -> None:
                while not stop.is_set() and len(samples) < 100_000:
                    violations.extend(c.check_pool("shared").violations)
                    if len(samples) % 20 == 0:  # the reaper's round (InProcessServer runs none)
                        server.call(expire)
                    samples.append(1)
                    stop.wait(0.005)

            run_beside(worker, 4, sample, stop)
            assert not violations, violations[:3]
            # every reservation's time (at most 1.5 s) runs out, on the server's lease clock
            # (see _reaped_until_none); the bound is on a hang only
            deadline = time.monotonic() + 120
            while True:
                server.call(expire)
                live = c.get_stats("shared").reservations.live
                if not live:
                    break
                assert time.monotonic() < deadline, f"{live} reservation(s) never ran out"
                time.sleep(0.05)
            final = c.get_stats("shared")
            assert c.check_pool("shared").violations == []

    finally:
        server.stop()
    faults = {k: sum(fi.counts[k] for fi in injectors + routers) for k in injectors[0].counts}
    print(f"two tenants, routers reserving: {counts} faults {faults} samples {len(samples)} "
          f"reservations {final.reservations}")  # fmt: skip
    assert counts["steps"] == 4 * 150 and counts["lost"] == 0
    assert counts["hits"] > 50 and counts["refusals"] > 0 and counts["routed"] > 100
    assert final.reservations.adopted > 20 and final.reservations.expired > 0
    assert final.num_requests == 0 and final.num_free_blocks == NUM_BLOCKS - 1, final


def test_workers_and_routers_on_a_journaled_pool_sigkilled_under_them_keep_their_blocks(
    tmp_path: Path,
) -> None:
    """Three workers on one pool of a journaled server, each request routed first by a
    router reserving its hit, answers lost, late, duplicated and re-delivered, while the
    server is SIGKILLed and started again three times: every request comes back with the
    blocks its worker was told (the tables are compared after every step), every hit
    reads the KV its prefix wrote, none is lost, and CheckPool finds nothing."""
    server = DurableServer(tmp_path)
    server.start()
    memory = KVMemory()
    counts: dict[str, int] = dict.fromkeys(
        ("steps", "hits", "refusals", "preemptions", "evictions", "lost", "routed"), 0
    )
    injectors: list[FaultInjector] = []
    routers: list[FaultInjector] = []
    stop = threading.Event()

    def worker(wid: int) -> None:
        # (patient clients: a restart at load outlasted the default policy's 8 attempts, and a
        # worker failed with UNAVAILABLE "connection refused", nothing wrong in its blocks)
        with routed_by_reservations(
            server.address, wid, counts, routers, None, share=0.5, retry=PATIENT
        ) as route:
            shared_worker(
                server.address, "shared", wid, 80, memory, counts, injectors, route=route, retry=PATIENT
            )

    def killer() -> None:
        for at in (40, 110, 180):  # steps done by all workers: the kills fall inside the run
            while counts["steps"] < at:
                if stop.wait(0.02):
                    return
            server.restart()

    try:
        with KVCoordClient(server.address, timeout=30) as c:
            c.create_pool("shared", shared_config())
        run_beside(worker, 3, killer, stop)
        with KVCoordClient(server.address, timeout=30) as c:
            assert c.check_pool("shared").violations == []
            final = c.get_stats("shared")
    finally:
        server.stop()
    print(f"journaled shared pool, {server.kills} kills: {counts} reservations {final.reservations}")
    assert server.kills == 3
    assert counts["steps"] == 3 * 80 and counts["lost"] == 0 and counts["hits"] > 30
    assert final.reservations.made > 10 and final.reservations.adopted > 5
    assert final.num_requests == 0
