"""The engine's update_and_allocate on decode steps, its decode fast path on and off,
in turns in one process (a paired figure; not a test).

    PYTHONPATH=client:server python bench/engine_decode.py [--running 256] [--steps 200] [--rounds 5]

Each round builds two pools of a layout (prefix caching and events on, block size 16),
admits ``--running`` requests with random prompts of 20-200 tokens, and replays the
same precomputed decode steps (one token each, its block hash when it completes one,
every token computed) through ``KVCachePool.update_and_allocate``, once with
``_decode_inside_blocks`` (the fast path) and once with it off; the loop thread's CPU
per call (``time.thread_time``). The two pools' snapshots must be equal.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec

BS = 16
LAYOUTS: dict[str, tuple[Any, ...]] = {
    "full16": (FullAttentionSpec(BS),),
    "full16+swa16w128": (FullAttentionSpec(BS), SlidingWindowSpec(BS, 128)),
}


def run(fast: bool, groups: tuple[Any, ...], steps: int, running: int, seed: int) -> tuple[float, object]:
    """µs of CPU per call and the pool's snapshot after the steps."""
    cfg = KVCacheConfig(
        num_blocks=running * 40,
        groups=groups,
        hash_block_size=BS,
        enable_kv_cache_events=True,
        max_model_len=4096,
    )
    pool = KVCachePool(cfg)
    pool.decode_fast_path = fast and pool.decode_fast_path
    rnd = random.Random(seed)
    none = none_hash("sha256_cbor", "0")
    hashers: dict[str, BlockHasher] = {}
    for i in range(running):
        rid = f"r{i}"
        prompt = [rnd.randrange(1000) for _ in range(rnd.randint(20, 200))]
        h = hashers[rid] = BlockHasher("sha256_cbor", BS, none)
        pool.add_request(rid, prompt, h.extend(prompt))
        pool.allocate_slots_with_lookup(rid, len(prompt))
    lens = {rid: pool.requests[rid].num_tokens for rid in hashers}
    calls = []
    for _ in range(steps):
        for rid, h in hashers.items():
            token = [rnd.randrange(1000)]
            calls.append((rid, lens[rid], token, h.extend(token)))
            lens[rid] += 1
    call = pool.update_and_allocate
    t0 = time.thread_time()
    for rid, computed, token, hashes in calls:
        call(rid, computed, token, hashes, 1)
    return (time.thread_time() - t0) / len(calls) * 1e6, pool.snapshot()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for name, groups in LAYOUTS.items():
        on: list[float] = []
        off: list[float] = []
        for r in range(args.rounds):
            a, snap_a = run(True, groups, args.steps, args.running, r)
            b, snap_b = run(False, groups, args.steps, args.running, r)
            assert snap_a == snap_b, "the fast path left another pool"
            on.append(a)
            off.append(b)
        fast, general = statistics.median(on), statistics.median(off)
        print(
            f"{name}: fast path {fast:.2f} µs/call, general {general:.2f} µs/call, ratio {fast / general:.2f}"
        )


if __name__ == "__main__":
    main()
