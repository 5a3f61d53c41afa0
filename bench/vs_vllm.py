"""kvcoord's engine against vLLM 0.16.0's own KVCacheManager, side by side. Not a test.

Needs vLLM 0.16.0 importable (it is not a kvcoord dependency) in a separate venv. On a
CPU machine:

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0 && /tmp/vllm-venv/bin/pip install --no-deps vllm==0.16.0
    # then the modules its import reports missing: numpy msgspec pydantic cbor2 xxhash
    # "transformers<5" einops psutil pyzmq urllib3 gguf aiohttp pillow pybase64 cachetools
    # cloudpickle py-cpuinfo prometheus_client openai-harmony openai llguidance
    # mistral_common diskcache xgrammar, and for kvcoord.client: grpcio protobuf
    # grpcio-health-checking
    PYTHONHASHSEED=0 /tmp/vllm-venv/bin/python bench/vs_vllm.py [--check-only | --skip-check]

Two parts:

1. Differential check: small seeded scheduler workloads (chunked prefill with prefix
   lookups, decode, preemption on refusal, frees) drive both managers on five layouts,
   with and without EAGLE. Every answer is compared: prefix hits, new block ids,
   refusals, free-block counts and, at the end, events and stats; the first difference
   stops the run.
2. Timings (skipped by --check-only): the serving workload of bench/engine.py -- 256
   requests kept running, prompts of 512-4,096 tokens, half starting with one of 8 shared
   prefixes, 16-256 output tokens, a token budget of 8,192 per step (chunks of at most
   2,048) -- on full16 and full16 + sliding16 (window 1024), 24,000 blocks, KV events on.
   Both managers run in lockstep: every call is timed on both sides back to back and
   their answers (hits, new blocks, free counts, and each step's KV events) must be
   identical. Reported per layout, in microseconds per call (the lowest mean of --reps
   runs): get_computed_blocks, allocate_slots for a decode step (one new token), for a
   request's first chunk (after its lookup, adopting the hit), for later prefill chunks,
   free (preemptions included), and kvcoord's request-table sync: add_request and
   update_request, which vLLM's scheduler does by mutating its own Request (so vLLM has
   no such row). Block hashing is excluded on both sides. The last row divides
   kvcoord's total time over all these calls, sync included, by vLLM's.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from kvcoord.client.hashing import BlockHasher, none_hash  # noqa: E402
from kvcoord.engine import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    hash_to_int64,
)

LAYOUTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "full16": [("full", {})],
    "full16+swa16(w128)": [("full", {}), ("swa", {"sliding_window": 128})],
    "full16+swa32(w128)": [("full", {}), ("swa32", {"sliding_window": 128})],
    "full16+swa16(w64)+swa16(w256)": [
        ("full", {}),
        ("swa", {"sliding_window": 64}),
        ("swa", {"sliding_window": 256}),
    ],
    "full16+mamba16(all)": [("full", {}), ("mamba", {})],
}


class Ours:
    def __init__(self, layout: list[tuple[str, dict[str, Any]]], num_blocks: int, eagle: bool) -> None:
        groups: list[Any] = []
        for kind, kw in layout:
            if kind == "full":
                groups.append(FullAttentionSpec(16))
            elif kind == "swa":
                groups.append(SlidingWindowSpec(16, kw["sliding_window"]))
            elif kind == "swa32":
                groups.append(SlidingWindowSpec(32, kw["sliding_window"]))
            else:
                groups.append(MambaSpec(16, MambaCacheMode.ALL))
        self.pool = KVCachePool(KVCacheConfig(num_blocks=num_blocks, groups=tuple(groups), hash_block_size=16,
                                              use_eagle=eagle, enable_kv_cache_events=True, max_model_len=8192))  # fmt: skip
        self.none = none_hash("sha256_cbor", "0")
        self.hashers: dict[str, BlockHasher] = {}

    def add(self, rid: str, tokens: list[int]) -> Callable[[], None]:
        """Hash the prompt now; the returned call is the pool's request-table sync."""
        self.hashers[rid] = BlockHasher("sha256_cbor", 16, self.none)
        hashes = self.hashers[rid].extend(tokens)
        return lambda: self.pool.add_request(rid, tokens, hashes)

    def lookup(self, rid: str) -> tuple[Any, list[list[int]], int]:
        hit = self.pool.get_computed_blocks(rid)
        return hit, [list(x) for x in hit.block_ids], hit.num_tokens

    def allocate(self, rid: str, n: int, hit_tokens: int = 0, hit: Any = None) -> list[list[int]] | None:
        out = self.pool.allocate_slots(rid, n, hit_tokens, hit)
        return None if out is None else [list(x) for x in out]

    # The timed calls: the manager's own answer, converted to ids outside the timer.
    def raw_lookup(self, rid: str) -> Any:
        return self.pool.get_computed_blocks(rid)

    def raw_allocate(self, rid: str, n: int, hit_tokens: int = 0, hit: Any = None) -> Any:
        return self.pool.allocate_slots(rid, n, hit_tokens, hit)

    def hit_ids(self, hit: Any) -> tuple[list[list[int]], int]:
        return [list(x) for x in hit.block_ids], hit.num_tokens

    def new_ids(self, out: Any) -> list[list[int]] | None:
        return None if out is None else [list(x) for x in out]

    def advance(self, rid: str, computed: int, appended: list[int]) -> Callable[[], None]:
        hashes = self.hashers[rid].extend(appended)
        return lambda: self.pool.update_request(
            rid, num_computed_tokens=computed, append_token_ids=appended, append_block_hashes=hashes
        )

    def free(self, rid: str) -> None:
        self.pool.free(rid)

    def preempt(self, rid: str) -> None:
        self.pool.preempt(rid)

    def num_free(self) -> int:
        return self.pool.num_free_blocks

    def finish(self) -> tuple[Any, ...]:
        s = self.pool.make_prefix_cache_stats()
        assert s is not None
        return len(self.pool.take_events()), s.requests, s.queries, s.hits, s.preempted_hits

    def events(self) -> list[tuple[Any, ...]]:
        return [_event_tuple(e) for e in self.pool.take_events()]


class VLLM:
    def __init__(self, layout: list[tuple[str, dict[str, Any]]], num_blocks: int, eagle: bool) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1 import kv_cache_interface as k
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256_cbor)
        specs: list[Any] = []
        common = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.float16}
        for kind, kw in layout:
            if kind == "full":
                specs.append(k.FullAttentionSpec(16, **common))
            elif kind in ("swa", "swa32"):
                specs.append(
                    k.SlidingWindowSpec(
                        16 if kind == "swa" else 32, sliding_window=kw["sliding_window"], **common
                    )
                )
            else:
                specs.append(k.MambaSpec(16, shapes=((8,),), dtypes=(torch.float16,), mamba_cache_mode="all"))
        groups = [k.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
        cfg = k.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.m = KVCacheManager(cfg, max_model_len=8192, hash_block_size=16, enable_caching=True, use_eagle=eagle,
                                log_stats=True, enable_kv_cache_events=True)  # fmt: skip
        self._make: Callable[[str, list[int]], Any] = lambda rid, toks: Request(
            rid,
            toks,
            SamplingParams(max_tokens=1000),
            None,
            None,
            block_hasher=get_request_block_hasher(16, sha256_cbor),
        )
        self.reqs: dict[str, Any] = {}

    def add(self, rid: str, tokens: list[int]) -> None:
        # vLLM's scheduler owns the Request: nothing to sync (its hashing is not timed).
        self.reqs[rid] = self._make(rid, tokens)

    def lookup(self, rid: str) -> tuple[Any, list[list[int]], int]:
        blocks, n = self.m.get_computed_blocks(self.reqs[rid])
        return blocks, [list(x) for x in blocks.get_block_ids()], n

    def allocate(self, rid: str, n: int, hit_tokens: int = 0, hit: Any = None) -> list[list[int]] | None:
        out = self.m.allocate_slots(self.reqs[rid], n, hit_tokens, hit)
        return None if out is None else [list(x) for x in out.get_block_ids(allow_none=False)]

    def raw_lookup(self, rid: str) -> Any:
        return self.m.get_computed_blocks(self.reqs[rid])

    def raw_allocate(self, rid: str, n: int, hit_tokens: int = 0, hit: Any = None) -> Any:
        return self.m.allocate_slots(self.reqs[rid], n, hit_tokens, hit)

    def hit_ids(self, hit: Any) -> tuple[list[list[int]], int]:
        blocks, n = hit
        return [list(x) for x in blocks.get_block_ids()], n

    def new_ids(self, out: Any) -> list[list[int]] | None:
        return None if out is None else [list(x) for x in out.get_block_ids(allow_none=False)]

    def advance(self, rid: str, computed: int, appended: list[int]) -> None:
        r = self.reqs[rid]
        r.num_computed_tokens = computed
        if appended:
            r.append_output_token_ids(appended)
        return None

    def free(self, rid: str) -> None:
        self.m.free(self.reqs.pop(rid))

    def preempt(self, rid: str) -> None:
        r = self.reqs[rid]
        self.m.free(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1

    def num_free(self) -> int:
        return int(self.m.block_pool.get_num_free_blocks())

    def finish(self) -> tuple[Any, ...]:
        s = self.m.make_prefix_cache_stats()
        return len(self.m.take_events()), s.requests, s.queries, s.hits, s.preempted_hits

    def events(self) -> list[tuple[Any, ...]]:
        return [_event_tuple(e) for e in self.m.take_events()]


def _event_tuple(event: Any) -> tuple[Any, ...]:
    """A KV event of either side as comparable values (hashes as vLLM's 64-bit integers)."""

    def h(x: Any) -> Any:
        return hash_to_int64(x) if isinstance(x, bytes) else x

    name = type(event).__name__
    if name == "BlockStored":
        return (name, tuple(map(h, event.block_hashes)), h(event.parent_block_hash), tuple(event.token_ids),
                event.block_size, event.lora_id, event.medium, event.lora_name)  # fmt: skip
    if name == "BlockRemoved":
        return (name, tuple(map(h, event.block_hashes)), event.medium)
    return (name,)


def workload(side: Any, seed: int, steps: int, timings: dict[str, list[float]] | None,
             trace: list[Any] | None) -> None:  # fmt: skip
    """A scheduler loop; appends every observable answer to ``trace``."""
    rnd = random.Random(seed)
    systems = [[rnd.randrange(32000) for _ in range(n)] for n in (64, 200, 500)]
    live: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    running: list[str] = []
    decode_left: dict[str, int] = {}
    pc = time.perf_counter
    nid = 0

    def rec(x: Any) -> None:
        if trace is not None:
            trace.append(x)

    def timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = pc()
        out = fn(*args)
        if timings is not None:
            timings[name].append(pc() - t0)
        return out

    for _ in range(steps):
        while len(live) < 24 and rnd.random() < 0.7:
            rid = f"r{nid}"
            nid += 1
            toks = (rnd.choice(systems) + [rnd.randrange(32000) for _ in range(rnd.randint(1, 700))])[:1200]
            live[rid] = toks
            computed[rid] = 0
            decode_left[rid] = rnd.randint(1, 40)
            sync = side.add(rid, list(toks))
            if sync is not None:
                sync()
        budget = 2048
        for rid in list(live):
            if budget <= 0:
                break
            toks = live[rid]
            if rid not in running:
                hit, ids, n_hit = timed("lookup", side.lookup, rid)
                rec(("hit", rid, ids, n_hit))
                n = min(len(toks) - n_hit, budget, 512)
                new = timed("allocate", side.allocate, rid, n, n_hit, hit)
                start = n_hit
            else:
                n = min(len(toks) - computed[rid], budget, 512)
                new = timed("allocate", side.allocate, rid, n)
                start = computed[rid]
            rec(("alloc", rid, new, side.num_free()))
            if new is None:
                if running:
                    victim = running.pop()
                    timed("free", side.preempt, victim)
                    computed[victim] = 0
                    rec(("preempt", victim, side.num_free()))
                continue
            if rid not in running:
                running.append(rid)
            computed[rid] = start + n
            budget -= n
            appended: list[int] = []
            if computed[rid] == len(toks):
                if decode_left[rid] == 0:
                    timed("free", side.free, rid)
                    rec(("free", rid, side.num_free()))
                    del live[rid]
                    running.remove(rid)
                    continue
                decode_left[rid] -= 1
                appended = [rnd.randrange(32000)]
                live[rid] = toks + appended
            sync = side.advance(rid, computed[rid], appended)
            if sync is not None:
                sync()
    rec(("end", side.finish()))


TIMED_OPS = ("lookup", "alloc_decode", "alloc_first", "alloc_chunk", "free", "sync_add", "sync_update")
OP_LABELS = {
    "lookup": "lookup",
    "alloc_decode": "allocate decode",
    "alloc_first": "allocate first chunk",
    "alloc_chunk": "allocate next chunk",
    "free": "free",
    "sync_add": "request sync: add",
    "sync_update": "request sync: update",
}


def serving_prompts(seed: int, n: int) -> list[tuple[list[int], int]]:
    """bench/engine.py's requests: 512-4,096-token prompts, half with one of 8 shared prefixes,
    16-256 output tokens."""
    rnd = random.Random(seed)
    systems = [[rnd.randrange(32000) for _ in range(rnd.randint(256, 2048))] for _ in range(8)]
    out = []
    for _ in range(n):
        length = rnd.randint(512, 4096)
        prefix = rnd.choice(systems) if rnd.random() < 0.5 else []
        body = [rnd.randrange(32000) for _ in range(max(1, length - len(prefix)))]
        out.append(((prefix + body)[:length], rnd.randint(16, 256)))
    return out


def serving_workload(sides: dict[str, Any], prompts: list[tuple[list[int], int]], steps: int,
                     timings: dict[str, dict[str, list[float]]]) -> int:  # fmt: skip
    """256 requests kept running under a token budget of 8,192 per step (chunks of at most
    2,048 tokens); a refusal preempts the most recently admitted running request.

    The sides run in lockstep: each operation is timed on every side, one right after the
    other, and their answers must be identical (so a burst of load from other processes
    hits both sides' samples alike). Returns the number of answers compared.
    """
    pc = time.perf_counter
    queue = list(prompts)
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    left: dict[str, int] = {}
    order: list[str] = []  # live requests, admission order
    running: list[str] = []
    nid = 0
    compared = 0

    def agree(what: str, answers: dict[str, Any]) -> Any:
        nonlocal compared
        values = list(answers.values())
        if any(v != values[0] for v in values[1:]):
            raise SystemExit(f"DIFFERENCE in {what}: {answers}")
        compared += 1
        return values[0]

    def call(op: str, method: str, *args: Any, per_side: dict[str, Any] | None = None) -> dict[str, Any]:
        """Time ``side.method(*args[, per_side[label]])`` on each side."""
        out = {}
        for label, side in sides.items():
            fn = getattr(side, method)
            full = args if per_side is None else (*args, per_side[label])
            t0 = pc()
            out[label] = fn(*full)
            timings[label][op].append(pc() - t0)
        return out

    def sync(method: str, *args: Any) -> None:
        op = "sync_add" if method == "add" else "sync_update"
        for label, side in sides.items():
            fn = getattr(side, method)(*args)  # hashing happens here, untimed
            if fn is not None:
                t0 = pc()
                fn()
                timings[label][op].append(pc() - t0)

    for _ in range(steps):
        while len(order) < 256 and queue:
            prompt, out_len = queue.pop()
            rid = f"s{nid}"
            nid += 1
            tokens[rid], computed[rid], left[rid] = list(prompt), 0, out_len
            sync("add", rid, list(prompt))
            order.append(rid)
        budget = 8192
        for rid in list(order):
            if budget <= 0:
                break
            toks = tokens[rid]
            if rid not in running:
                raw_hits = call("lookup", "raw_lookup", rid)
                ids, n_hit = agree(f"lookup {rid}", {k: sides[k].hit_ids(h) for k, h in raw_hits.items()})
                n = min(len(toks) - n_hit, 2048, budget)
                hits = {k: (h if isinstance(sides[k], Ours) else h[0]) for k, h in raw_hits.items()}
                raw = call("alloc_first", "raw_allocate", rid, n, n_hit, per_side=hits)
                start = n_hit
            else:
                n = min(len(toks) - computed[rid], 2048, budget)
                op = "alloc_decode" if computed[rid] == len(toks) - 1 else "alloc_chunk"
                raw = call(op, "raw_allocate", rid, n)
                start = computed[rid]
            new = agree(f"allocate {rid}", {k: sides[k].new_ids(r) for k, r in raw.items()})
            agree("free blocks", {k: side.num_free() for k, side in sides.items()})
            if new is None:
                if running:
                    victim = running.pop()
                    call("free", "preempt", victim)
                    computed[victim] = 0
                continue
            if rid not in running:
                running.append(rid)
            computed[rid] = start + n
            budget -= n
            appended: list[int] = []
            if computed[rid] == len(toks):
                if left[rid] == 0:
                    call("free", "free", rid)
                    agree("free blocks", {k: side.num_free() for k, side in sides.items()})
                    order.remove(rid)
                    running.remove(rid)
                    continue
                left[rid] -= 1
                appended = [(computed[rid] * 7919) % 32000]
                toks.extend(appended)
            sync("advance", rid, computed[rid], appended)
        # A scheduler drains the KV events every step (vLLM's does in schedule()); untimed.
        agree("events", {k: side.events() for k, side in sides.items()})
    agree("events and stats", {k: side.finish() for k, side in sides.items()})
    return compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true", help="only the differential check")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip-check", action="store_true", help="only the timings")
    parser.add_argument("--serving-steps", type=int, default=400, help="scheduler steps of the timed run")
    parser.add_argument("--requests", type=int, default=1500, help="requests in the timed run")
    parser.add_argument("--blocks", type=int, default=24000, help="pool size of the timed run")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per side (lowest mean kept)")
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("run with PYTHONHASHSEED=0 so that vLLM's NONE_HASH is the seeded one")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("vLLM 0.16.0 is not importable here; see this file's docstring") from None
    compared = 0
    for name, layout in [] if args.skip_check else LAYOUTS.items():
        for eagle in (False, True):
            if eagle and name == "full16+swa32(w128)":
                continue  # EAGLE needs sliding block size == LCM: refused by both
            for seed in range(args.seeds):
                num_blocks = 400 + 200 * seed
                a: list[Any] = []
                b: list[Any] = []
                workload(VLLM(layout, num_blocks, eagle), seed, args.steps, None, a)
                workload(Ours(layout, num_blocks, eagle), seed, args.steps, None, b)
                for i, (x, y) in enumerate(zip(a, b, strict=False)):
                    if x != y:
                        raise SystemExit(
                            f"DIFFERENCE {name} eagle={eagle} seed={seed} at answer {i}: vLLM {x} vs ours {y}"
                        )
                if len(a) != len(b):
                    raise SystemExit(f"DIFFERENCE {name}: {len(a)} vs {len(b)} answers")
                compared += len(a)
                print(
                    f"identical  {name:<31} eagle={eagle!s:<5} seed={seed} blocks={num_blocks}: {len(a)} answers",
                    flush=True,
                )
    print(f"differential check: {compared} answers identical to vLLM 0.16.0")
    if args.check_only:
        return
    serving_layouts = {
        "full16": [("full", {})],
        "full16+swa16(w1024)": [("full", {}), ("swa", {"sliding_window": 1024})],
    }
    prompts = serving_prompts(7, args.requests)
    rows: list[tuple[str, str, float, float]] = []
    for name, layout in serving_layouts.items():
        # Per side and op, the lowest mean over --reps runs (the two sides alternate, so
        # a burst of load on a shared machine hits one run, not one side).
        res: dict[str, dict[str, list[float]]] = {}
        best: dict[str, dict[str, float]] = {"vllm": {}, "ours": {}}
        n = 0
        for _rep in range(args.reps):
            sides = {"vllm": VLLM(layout, args.blocks, False), "ours": Ours(layout, args.blocks, False)}
            res = {label: {op: [] for op in TIMED_OPS} for label in sides}
            # torch leaves a large heap; freeze it so neither side pays for GC passes
            # over objects it did not create (the server freezes its pools likewise).
            gc.collect()
            gc.freeze()
            n = serving_workload(sides, prompts, args.serving_steps, res)
            gc.unfreeze()
            for label in sides:
                for op in TIMED_OPS:
                    if res[label][op]:
                        mean = statistics.fmean(res[label][op])
                        best[label][op] = min(best[label].get(op, mean), mean)
        print(f"identical  serving {name}: {n} answers", flush=True)
        total = {"vllm": 0.0, "ours": 0.0}
        for op in TIMED_OPS:
            calls = len(res["ours"][op])
            vm = best["vllm"].get(op, float("nan"))
            om = best["ours"].get(op, float("nan"))
            total["vllm"] += vm * calls if vm == vm else 0.0
            total["ours"] += om * calls
            rows.append((name, f"{OP_LABELS[op]} ({calls})", vm * 1e6, om * 1e6))
        rows.append((name, "kvcoord incl. sync / vLLM", total["vllm"], total["ours"]))
    print(f"\n{'layout':<22}{'op (calls)':<30}{'vLLM us':>10}{'kvcoord us':>12}{'kvcoord/vLLM':>14}")
    for name, op, v, o in rows:
        if op.startswith("kvcoord incl"):
            print(f"{name:<22}{op:<30}{v:>10.3f}s{o:>11.3f}s{o / v:>14.2f}")
        elif v != v:  # vLLM has no such call
            print(f"{name:<22}{op:<30}{'-':>10}{o:>12.2f}{'-':>14}")
        else:
            print(f"{name:<22}{op:<30}{v:>10.2f}{o:>12.2f}{o / v:>14.2f}")


if __name__ == "__main__":
    main()
