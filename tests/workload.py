"""A scheduler-like worker process and a pool-wide checker, used by the many-worker tests
(against an in-test server process and against the dockerized server)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import time
from collections import defaultdict
from typing import Any

from kvcoord.client import KVCoordClient, RemoteKVCacheManager, TLSOptions
from kvcoord.v1 import allocator_pb2 as pb

SHARED_PREFIXES_SEED = 99


def pool_config(num_blocks: int = 300, block_size: int = 16, window: int = 64) -> pb.PoolConfig:
    """full + sliding window, by default full16 + sliding16 (w64): small enough that four
    workers hit refusals."""
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=block_size)),
            pb.KVCacheGroupSpec(
                sliding_window=pb.SlidingWindowSpec(block_size=block_size, sliding_window=window)
            ),
        ],
        hash_block_size=block_size,
        enable_caching=True,
        enable_kv_cache_events=True,
        max_model_len=2048,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )


@dataclasses.dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    decode_left: int
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    running: bool = False


def run_worker(
    address: str, pool: str, wid: int, seed: int, steps: int, out: Any, tls: TLSOptions | None = None
) -> None:
    """One scheduler: admits requests with shared prefixes, chunks prefill, decodes,
    preempts the newest running request on a refusal, frees finished ones; frees all at
    the end. Puts a summary dict on ``out``."""
    rnd = random.Random(seed)
    prefix_rnd = random.Random(SHARED_PREFIXES_SEED)
    prefixes = [[prefix_rnd.randrange(30000) for _ in range(n)] for n in (32, 64, 100)]
    summary = {
        "worker": wid,
        "allocs": 0,
        "refusals": 0,
        "hit_tokens": 0,
        "preemptions": 0,
        "finished": 0,
        "error": "",
    }
    try:
        with KVCoordClient(address, timeout=20, tls=tls) as client:
            m = RemoteKVCacheManager(client, pool, hash_seed="0", client_name=f"worker-{wid}")
            live: list[Req] = []
            running: list[Req] = []
            for step in range(steps):
                if len(live) < 6 and rnd.random() < 0.6:
                    body = [rnd.randrange(30000) for _ in range(rnd.randint(8, 200))]
                    live.append(Req(f"w{wid}-{step}", rnd.choice(prefixes) + body, rnd.randint(2, 12)))
                budget = 256
                for r in list(live):
                    if budget <= 0:
                        break  # also here: a request that finishes skips the check below
                    if r.running:
                        n = min(len(r.all_token_ids) - r.num_computed_tokens, budget)
                        new = m.allocate_slots(r, n)
                    else:
                        hit, hit_tokens = m.get_computed_blocks(r)
                        n = min(len(r.all_token_ids) - hit_tokens, budget)
                        new = m.allocate_slots(r, n, hit_tokens, hit)
                        if new is not None:
                            summary["hit_tokens"] += hit_tokens
                            r.num_computed_tokens = hit_tokens
                    if new is None:
                        summary["refusals"] += 1
                        if running:
                            victim = running.pop()
                            m.free(victim)
                            victim.running = False
                            victim.num_computed_tokens = 0
                            victim.num_preemptions += 1
                            summary["preemptions"] += 1
                        continue
                    summary["allocs"] += 1
                    if not r.running:
                        r.running = True
                        running.append(r)
                    r.num_computed_tokens += n
                    budget -= n
                    if r.num_computed_tokens == len(r.all_token_ids):
                        if r.decode_left == 0:
                            m.free(r)
                            live.remove(r)
                            running.remove(r)
                            summary["finished"] += 1
                            continue
                        r.decode_left -= 1
                        r.all_token_ids = r.all_token_ids + [rnd.randrange(30000)]
                    if budget <= 0:
                        break
            for r in live:
                m.free(r)
            m.close()
    except Exception as exc:  # reported to the parent, which fails the test
        summary["error"] = f"{type(exc).__name__}: {exc}"
    out.put(summary)


def check_pool(client: KVCoordClient, pool: str, num_blocks: int) -> int:
    """Raise AssertionError unless every block is held consistently; returns #live requests.

    A block held by two live requests must be shared through the prefix cache: it holds
    a cache hash and sits at the same position of the same group in both tables. Held
    blocks are never in the free queue, and free + held = capacity.
    """
    snap = client.inspect_pool(
        pool, free_queue_limit=num_blocks, all_requests=True, include_cached_blocks=True
    )
    cached = set(snap.cached_block_ids)
    free = list(snap.free_queue_head)
    assert len(free) == len(set(free)) == snap.num_free_blocks, "free queue inconsistent"
    holders: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for state in snap.requests:
        for g, ids in enumerate(state.groups):
            for pos, bid in enumerate(ids.block_ids):
                if bid != 0:
                    holders[bid].append((state.request_id, g, pos))
    for bid, where in holders.items():
        assert bid not in free, f"block {bid} is held by {where} and free"
        if len(where) > 1:
            assert bid in cached, f"block {bid} shared by {where} but not a prefix-cache block"
            assert len({(g, pos) for _, g, pos in where}) == 1, f"block {bid} at different positions: {where}"
            assert len({rid for rid, _, _ in where}) == len(where), f"block {bid} twice in one table: {where}"
    assert len(holders) + len(free) == num_blocks - 1, "held + free != capacity"
    return len(snap.requests)


def run_many_workers(address: str, pool: str, num_workers: int = 4, steps: int = 40,
                     time_limit: float = 240.0, tls: TLSOptions | None = None) -> dict[str, Any]:  # fmt: skip
    """Start workers as processes, check the pool while they run and at the end."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=run_worker, args=(address, pool, w, 1000 + w, steps, out, tls))
        for w in range(num_workers)
    ]
    for p in procs:
        p.start()
    samples = busy = 0
    deadline = time.monotonic() + time_limit
    with KVCoordClient(address, timeout=20, tls=tls) as client:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            live = check_pool(client, pool, num_blocks=client.get_pool(pool).pool.config.num_blocks)
            samples += 1
            busy += live > 0
            time.sleep(0.02)
        results = [out.get(timeout=min(30.0, max(1.0, deadline - time.monotonic()))) for _ in procs]
        for p in procs:
            p.join(10)
        num_blocks = client.get_pool(pool).pool.config.num_blocks
        check_pool(client, pool, num_blocks)
        stats = client.get_stats(pool)
        reset = client.reset_prefix_cache(pool).result
    return {"results": results, "samples": samples, "busy_samples": busy, "final": stats, "reset": reset,
            "num_blocks": num_blocks}  # fmt: skip
