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
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import Req
from workload import check_pool, pool_config, run_worker

NUM_BLOCKS = 60
BLOCK = 4


def shared_config() -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=NUM_BLOCKS,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BLOCK))],
        hash_block_size=BLOCK,
        enable_caching=True,
        enable_kv_cache_events=True,
        max_model_len=256,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )


class KVMemory:
    """The workers' KV memory, modelled: block id -> the token prefix its KV was computed
    for. A worker allocating, writing and checking its hits holds :attr:`turn`, so no
    other worker hits a block between the server caching it and its writer writing it
    (the race engines sharing a pool rule out themselves)."""

    def __init__(self) -> None:
        self.turn = threading.Lock()
        self.kv: dict[int, tuple[int, ...]] = {}

    def write(self, blocks: list[int], tokens: list[int], computed: int, n: int) -> None:
        """The KV of tokens ``computed .. computed + n`` written to their blocks."""
        for i in range(computed // BLOCK, (computed + n + BLOCK - 1) // BLOCK):
            self.kv[blocks[i]] = tuple(tokens[: min(BLOCK * (i + 1), computed + n)])

    def check_hit(self, blocks: list[int], tokens: list[int], where: str) -> None:
        for i, b in enumerate(blocks):
            want = tuple(tokens[: BLOCK * (i + 1)])
            assert self.kv.get(b) == want, f"{where}: hit block {b} (index {i}) holds KV of {self.kv.get(b)}"


def server_tables(client: KVCoordClient, pool: str) -> dict[str, list[int]]:
    resp = client.inspect_pool(pool, all_requests=True)
    return {r.request_id: list(r.groups[0].block_ids) for r in resp.requests}


def shared_worker(address: str, pool: str, wid: int, steps: int, memory: KVMemory, counts: dict[str, int],
                  injectors: list[FaultInjector]) -> None:  # fmt: skip
    """A small scheduler on the shared pool: admits prompts sharing prefixes with the other
    workers', prefills in chunks, decodes, preempts the newest on a refusal, frees, and
    now and then evicts a block id (as a failed KV load does)."""
    rnd = random.Random(100 + wid)
    # the same prefixes in every worker: they hit each other's blocks
    prefixes = [[random.Random(7 + i).randrange(50) for _ in range(n)] for i, n in enumerate((0, 8, 13, 24))]
    fi = FaultInjector(200 + wid, drop=0.05, delay=0.05, duplicate=0.05, reorder=0.05)
    injectors.append(fi)
    with KVCoordClient(address, interceptors=[fi]) as c, KVCoordClient(address) as plain:
        m = RemoteKVCacheManager(c, pool, hash_seed="0", client_name=f"w{wid}")
        live: dict[str, Req] = {}
        mine: dict[str, list[int]] = {}  # the block table each request was answered
        running: list[str] = []

        def free(rid: str) -> None:
            m.free(live.pop(rid))
            mine.pop(rid, None)
            if rid in running:
                running.remove(rid)

        for step in range(steps):
            if rnd.random() < 0.5:
                rid = f"w{wid}-r{step}"
                body = [rnd.randrange(50) for _ in range(rnd.randint(1, 30))]
                live[rid] = Req(rid, (rnd.choice(prefixes) + body)[:60])
            for rid in sorted(live):
                if rid not in live:
                    continue  # preempted by a refusal this step
                r = live[rid]
                if rnd.random() < 0.08 or r.num_computed_tokens >= 120:
                    free(rid)
                    continue
                with memory.turn:
                    if rid not in running:
                        hit, computed = m.get_computed_blocks(r)
                        n = min(len(r.all_token_ids) - computed, rnd.choice([4, 16, 64]))
                        got = m.allocate_slots(r, n, computed, hit)
                        base = list(hit.get_block_ids()[0])
                    else:
                        computed = r.num_computed_tokens
                        n = min(len(r.all_token_ids) - computed, 16)
                        if n == 0:
                            continue
                        got = m.allocate_slots(r, n)
                        base = mine[rid]
                    if got is not None:
                        mine[rid] = base + list(got.get_block_ids()[0])
                        memory.write(mine[rid], r.all_token_ids, computed, n)
                        if rid not in running and computed:
                            memory.check_hit(mine[rid][: computed // BLOCK], r.all_token_ids, f"w{wid} {rid}")
                            counts["hits"] += 1
                if got is None:
                    counts["refusals"] += 1
                    if rid not in running:
                        mine[rid] = []  # registered, nothing allocated
                    if running and running[-1] != rid:
                        free(running[-1])
                        counts["preemptions"] += 1
                    continue
                if rid not in running:
                    running.append(rid)
                r.num_computed_tokens = computed + n
                if r.num_computed_tokens == len(r.all_token_ids):
                    r.all_token_ids = r.all_token_ids + [step % 50]
            if rnd.random() < 0.05:
                m.evict_blocks([rnd.randrange(1, NUM_BLOCKS)])
                counts["evictions"] += 1
            m.flush()  # frees ride with the next call: the step ends here
            held = {k: v for k, v in server_tables(plain, pool).items() if k.startswith(f"w{wid}-")}
            assert held == mine, f"w{wid} step {step}: the server holds {held}, the worker was told {mine}"
            counts["steps"] += 1
        for rid in list(live):
            free(rid)
        m.flush()
        counts["lost"] += m.lost_requests
        m.close()


def run_threads(target: Any, count: int, *args: Any) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(wid: int) -> None:
        try:
            target(wid, *args)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return errors


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

        checker = threading.Thread(target=sample)
        checker.start()
        try:
            errors = run_threads(
                lambda w: shared_worker(server.address, "shared", w, 150, memory, counts, injectors), 4
            )
        finally:
            stop.set()
            checker.join(60)
        assert not errors, errors[0]
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
            # every lease (at most 2 s) has run out 2.5 s after the last kill
            time.sleep(2.5)
            server.call(server.running.servicer.reap_expired_sessions)  # type: ignore[union-attr]
            check_pool(c, "p", num_blocks)
            stats = c.get_stats("p")
            assert c.check_pool("p").violations == []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()
    assert stats.num_requests == 0 and stats.num_free_blocks == num_blocks - 1, stats
