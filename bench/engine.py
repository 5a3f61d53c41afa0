"""Engine benchmark: a scheduler-like workload at three pool sizes, side by side.

Not a test. Run from the repository root:

    python bench/engine.py            # full run (about a minute or two)
    python bench/engine.py --quick    # smaller, for a smoke check

Workload (per layout): up to 256 concurrent requests with prompts of 512-4096 tokens,
half of them starting with one of 8 shared system prompts; each step has a token
budget, waiting requests are looked up and admitted with a chunk of their prompt,
partially prefilled ones continue in chunks, decoding ones get one token; a refusal
preempts the most recently admitted running request (as vLLM's scheduler does);
finished requests are freed and replaced. The same seeded workload runs on a pool of
N, 10N and 100N blocks. Block hashes are computed by the client library outside the
timed engine calls (their cost is reported separately).

Prints microseconds per get_computed_blocks / allocate_slots / free, engine
operations per second, and each size's per-op cost as a ratio of the 1x pool's.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from kvcoord.client.hashing import BlockHasher, none_hash  # noqa: E402
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec  # noqa: E402

BS = 16
NONE = none_hash("sha256_cbor", "0")


@dataclass
class Req:
    rid: str
    tokens: list[int]
    hasher: BlockHasher
    decode_left: int
    computed: int = 0
    running: bool = False


@dataclass
class Timings:
    lookup: list[int] = field(default_factory=list)
    allocate: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    other: list[int] = field(default_factory=list)
    hash_ns: int = 0
    hashed_blocks: int = 0
    refusals: int = 0
    preemptions: int = 0
    hit_tokens: int = 0


def make_requests(seed: int, n: int) -> list[tuple[list[int], int]]:
    rnd = random.Random(seed)
    systems = [[rnd.randrange(32000) for _ in range(rnd.randint(256, 2048))] for _ in range(8)]
    out = []
    for _ in range(n):
        length = rnd.randint(512, 4096)
        prefix = rnd.choice(systems) if rnd.random() < 0.5 else []
        body = [rnd.randrange(32000) for _ in range(max(1, length - len(prefix)))]
        out.append(((prefix + body)[:length], rnd.randint(16, 128)))
    return out


def run(groups: tuple, num_blocks: int, workload: list[tuple[list[int], int]], steps: int) -> Timings:
    cfg = KVCacheConfig(num_blocks=num_blocks, groups=groups, hash_block_size=BS, max_model_len=8192)
    pool = KVCachePool(cfg)
    # Millions of long-lived block objects make CPython's full GC passes cost hundreds of
    # milliseconds; the server freezes them after creating a pool, and so does this run.
    gc.freeze()
    t = Timings()
    pc = time.perf_counter_ns
    queue = list(workload)
    live: list[Req] = []
    running_order: list[Req] = []
    next_id = 0
    budget_tokens = 8192
    for _ in range(steps):
        while len(live) < 256 and queue:
            prompt, decode = queue.pop()
            h = BlockHasher("sha256_cbor", BS, NONE)
            t0 = pc()
            hashes = h.extend(prompt)
            t.hash_ns += pc() - t0
            t.hashed_blocks += len(hashes)
            r = Req(f"r{next_id}", list(prompt), h, decode)
            next_id += 1
            t0 = pc()
            pool.add_request(r.rid, prompt, hashes)
            t.other.append(pc() - t0)
            live.append(r)
        budget = budget_tokens
        for r in list(live):
            if budget <= 0:
                break
            if r not in live:
                continue
            if not r.running:
                t0 = pc()
                hit = pool.get_computed_blocks(r.rid)
                t.lookup.append(pc() - t0)
                n = min(len(r.tokens) - hit.num_tokens, 2048, budget)
                t0 = pc()
                new = pool.allocate_slots(r.rid, n, hit.num_tokens, hit)
                t.allocate.append(pc() - t0)
                if new is None:
                    t.refusals += 1
                    continue
                t.hit_tokens += hit.num_tokens
                r.running = True
                r.computed = hit.num_tokens
                running_order.append(r)
            else:
                n = min(len(r.tokens) - r.computed, 2048, budget)
                t0 = pc()
                new = pool.allocate_slots(r.rid, n)
                t.allocate.append(pc() - t0)
                if new is None:
                    t.refusals += 1
                    victim = running_order.pop()
                    t0 = pc()
                    pool.preempt(victim.rid)
                    t.free.append(pc() - t0)
                    victim.running = False
                    victim.computed = 0
                    t.preemptions += 1
                    continue
            budget -= n
            r.computed += n
            appended: list[int] = []
            if r.computed == len(r.tokens):
                if r.decode_left == 0:
                    t0 = pc()
                    pool.free(r.rid)
                    t.free.append(pc() - t0)
                    live.remove(r)
                    running_order.remove(r)
                    continue
                r.decode_left -= 1
                appended = [r.computed % 32000]
                r.tokens += appended
            t0 = pc()
            hashes = r.hasher.extend(appended)
            t.hash_ns += pc() - t0
            t.hashed_blocks += len(hashes)
            t0 = pc()
            pool.update_request(
                r.rid, num_computed_tokens=r.computed, append_token_ids=appended, append_block_hashes=hashes
            )
            t.other.append(pc() - t0)
    return t


def fmt_us(samples: list[int]) -> str:
    """Mean/median in microseconds."""
    if not samples:
        return "-"
    return f"{statistics.fmean(samples) / 1000:.1f}/{statistics.median(samples) / 1000:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and requests")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    steps = 60 if args.quick else 250
    base = 24_000
    workload = make_requests(args.seed, 400 if args.quick else 1500)
    layouts = {
        "full16": (FullAttentionSpec(BS),),
        "full16+swa16(w1024)": (FullAttentionSpec(BS), SlidingWindowSpec(BS, 1024)),
    }
    print(
        f"python {sys.version.split()[0]}; {steps} scheduler steps; 256 concurrent requests; "
        f"prompts 512-4096 tokens, half with shared prefixes"
    )
    print(
        "per-op columns: mean/median microseconds; 'x' columns: mean cost relative to the previous "
        "(10x smaller) pool. The 1x pool is under memory pressure (refusals, preemptions, evicted "
        "hits), so 10x vs 1x compares different workloads; 100x vs 10x runs the identical one."
    )
    header = (
        f"{'layout':<22}{'blocks':>10}{'lookup us':>12}{'alloc us':>11}{'free us':>11}"
        f"{'engine ops/s':>14}{'refusals':>10}{'preempt':>9}{'hit tok':>10}"
        f"{'lookup x':>10}{'alloc x':>9}{'free x':>8}"
    )
    print(header)
    for name, groups in layouts.items():
        ref: tuple[float, float, float] | None = None
        for mult in (1, 10, 100):
            gc.collect()
            t = run(groups, base * mult, workload, steps)
            gc.unfreeze()
            means = tuple(statistics.fmean(x) if x else 0.0 for x in (t.lookup, t.allocate, t.free))
            if ref is None:
                ref = means  # type: ignore[assignment]
            assert ref is not None
            ops = len(t.lookup) + len(t.allocate) + len(t.free) + len(t.other)
            secs = (sum(t.lookup) + sum(t.allocate) + sum(t.free) + sum(t.other)) / 1e9
            ratios = [m / r if r else float("nan") for m, r in zip(means, ref, strict=False)]
            print(
                f"{name:<22}{base * mult:>10}{fmt_us(t.lookup):>12}{fmt_us(t.allocate):>11}"
                f"{fmt_us(t.free):>11}{ops / secs:>14,.0f}{t.refusals:>10}{t.preemptions:>9}"
                f"{t.hit_tokens:>10}{ratios[0]:>10.2f}{ratios[1]:>9.2f}{ratios[2]:>8.2f}"
            )
            ref = means  # type: ignore[assignment]
        print(
            f"{'':<22}client hashing: {t.hash_ns / max(t.hashed_blocks, 1) / 1000:.2f} us per block "
            f"(sha256_cbor, {t.hashed_blocks} blocks)"
        )


if __name__ == "__main__":
    main()
