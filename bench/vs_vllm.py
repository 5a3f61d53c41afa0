"""kvcoord's engine against vLLM's own KVCacheManager (0.16.0 or 0.33.0), side by side.
Not a test.

Needs vLLM importable (it is not a kvcoord dependency) in a separate venv; the installed
release picks the comparison (``--vllm`` names the one expected):

- vLLM 0.16.x: kvcoord's default ``vllm-0.16`` pools, both parts below.
- vLLM 0.33.x: kvcoord's ``vllm-0.33`` pools, the differential check only (part 3):

    KVCOORD_VLLM_VERSION=0.33.0 scripts/install_vllm.sh    # /var/cache/kvcoord/vllm033-venv
    PYTHONHASHSEED=0 /var/cache/kvcoord/vllm033-venv/bin/python bench/vs_vllm.py --check-only \
        [--seeds 3] [--steps 150] [--layouts full16 ...]

For vLLM 0.16.0 on a CPU machine (or scripts/install_vllm.sh):

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
3. Under vLLM 0.33.0 (``workload033``, ``check033``): vLLM 0.33's synchronous scheduler
   loop reduced to its manager calls (``new_step_starts``, running requests first with
   preemption on refusal, admissions that must fit the whole sequence, statistics at
   admission, ``estimate_cached_tokens`` at a request's first output, shared-prefix
   boundaries kept on the request, EAGLE's drafts with look-ahead
   slots and ``cache_blocks`` after each output, aborts, resets plain and after preempting
   everything, resent prompts and next turns of finished conversations) drives vLLM
   0.33.0's manager and a ``vllm-0.33`` pool on fifteen layouts (``LAYOUTS_033``: full
   attention, sliding windows of 16- and 32-token blocks, two windows, chunked local,
   full attention of two block sizes, both with a window, full attention with a mamba
   "align" group, which has 2 speculative blocks with EAGLE/MTP on, its prefill chunks
   ending on block boundaries as 0.33's scheduler clips them, and the same with one
   prefill checkpoint block, and one MLA group), with prefix caching on and
   off and EAGLE on and off, set up as vLLM 0.33's engine sets up its manager (hash
   blocks of the GCD of the block sizes, hits and caching aligned to their LCM, sparse
   sliding-window retention unless the layout sets another (a window alone, periodic
   intervals, dense); EAGLE: one look-ahead hash token with caching on, and also the
   trailing-block drop with legacy hashes, as 0.33 runs it beside a KV connector or with
   ``disable_lookahead_block_hashes``, in the draft's group (the first) or in every group
   (none flagged); the drop with caching off). Every answer is compared: hits and shared-prefix boundaries, new block
   ids and refusals, free counts after each call, every running request's block table
   and the free queue's head after each step's scheduling, and each step's KV events
   (0.33's fields included) and prefix-cache statistics; the first difference stops the
   run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import logging
import math
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

from kvcoord.client.hashing import BlockHasher, block_hasher, none_hash  # noqa: E402
from kvcoord.engine import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    ConfigError,
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    LoRA,
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
        groups = [_ours_spec(kind, kw) for kind, kw in layout]
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


# --- vLLM 0.33.0 (--vllm 0.33): its manager against kvcoord's vllm-0.33 pools ----------

#: layout name -> groups ``(kind, options)``; kinds: full/full32 (full attention, 16- or
#: 32-token blocks), swa/swa32 (sliding window), chunked (chunked local attention, 16).
#: mamba_align: mamba in "align" mode (16), with SPEC_TOKENS_033 speculative blocks when
#: EAGLE/MTP is on; mamba_align_ckpt: the same with one prefill checkpoint block
#: (alignment 1, as vLLM 0.33's Mamba2 layers set it). mla: one MLA group (16), as
#: DeepSeek V2/V3/R1 and Kimi K2 have (with EAGLE on: MTP's one look-ahead token).
LAYOUTS_033: dict[str, list[tuple[str, dict[str, Any]]]] = {
    **{name: layout for name, layout in LAYOUTS.items() if "mamba" not in name},
    "full16+chunked16(c64)": [("full", {}), ("chunked", {"attention_chunk_size": 64})],
    "full16+full32": [("full", {}), ("full32", {})],
    "full16+full32+swa16(w64)": [("full", {}), ("full32", {}), ("swa", {"sliding_window": 64})],
    # mamba "align" (0.33's only caching mode); with EAGLE/MTP on, one speculative block
    # per draft token
    "full16+mamba16(align)": [("full", {}), ("mamba_align", {})],
    # a positive prefix_cache_retention_interval (a window tail once per interval) and
    # dense retention (None: a tail at every scheduler block) where a window tail is
    # shorter than the segment
    "swa16(w64)": [("swa", {"sliding_window": 64})],
    "swa16(w16) r64": [("swa", {"sliding_window": 16, "retention": 64})],
    "full16+swa16(w32) r64": [("full", {}), ("swa", {"sliding_window": 32, "retention": 64})],
    "full32+swa16(w16) r128": [("full32", {}), ("swa", {"sliding_window": 16, "retention": 128})],
    "full32+swa16(w16) dense": [("full32", {}), ("swa", {"sliding_window": 16, "retention": None})],
    "full16+mamba16(align,ckpt)": [("full", {}), ("mamba_align_ckpt", {})],
    "mla16": [("mla", {})],
}
#: the scheduler's token budget per step, and so vLLM 0.33's max_in_flight_tokens (one
#: batch in flight: the synchronous scheduler)
BUDGET_033 = 2048
#: EAGLE's draft tokens per decode step (num_speculative_tokens)
SPEC_TOKENS_033 = 2
#: the LoRA adapters some requests use: (id, name); the path is ``loras/<name>``
LORAS_033 = ((1, "adapter-a"), (2, "adapter-b"))


def _block_sizes(layout: list[tuple[str, dict[str, Any]]]) -> list[int]:
    return [32 if kind in ("full32", "swa32") else 16 for kind, _ in layout]


def _retention(layout: list[tuple[str, dict[str, Any]]]) -> int | None:
    """The layout's prefix_cache_retention_interval (a group's ``retention`` option;
    0.33's default 0, sparse, when none gives one)."""
    for _, kw in layout:
        if "retention" in kw:
            return kw["retention"]
    return 0


def _ours_spec(kind: str, kw: dict[str, Any], spec_blocks: int = 0) -> Any:
    size = 32 if kind in ("full32", "swa32") else 16
    if kind in ("mamba_align", "mamba_align_ckpt"):
        ckpt = int(kind == "mamba_align_ckpt")
        return MambaSpec(16, MambaCacheMode.ALIGN, spec_blocks, num_prefill_checkpoint_blocks=ckpt,
                         prefill_checkpoint_alignment=1 if ckpt else None)  # fmt: skip
    if kind in ("full", "full32", "mla"):
        return FullAttentionSpec(size, use_mla=kind == "mla")
    if kind in ("swa", "swa32"):
        return SlidingWindowSpec(size, kw["sliding_window"])
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(size, kw["attention_chunk_size"])
    return MambaSpec(16, MambaCacheMode.ALL)


class Ours033(Ours):
    """kvcoord's engine with a ``vllm-0.33`` pool, set up as vLLM 0.33's engine core sets
    up its manager: hash blocks of the GCD of the block sizes, hits and caching aligned to
    their LCM, the layout's sliding-window retention (sparse, interval 0, unless a group's
    ``retention`` option says otherwise), and for EAGLE with caching on
    look-ahead hashes of one token and no last-block drop."""

    def __init__(self, layout: list[tuple[str, dict[str, Any]]], num_blocks: int, eagle: bool,
                 caching: bool = True, drop: str = "", zeroing: bool = False) -> None:  # fmt: skip
        sizes = _block_sizes(layout)
        self.mamba_align = any(kind.startswith("mamba_align") for kind, _ in layout)
        self.sched_block = math.lcm(*sizes)
        self.hash_block = math.gcd(*sizes)
        self.lookahead = 1 if eagle and caching and not drop else 0
        spec_blocks = SPEC_TOKENS_033 if eagle else 0
        self.pool = KVCachePool(KVCacheConfig(
            use_eagle=eagle and not self.lookahead, eagle_group_ids=(0,) if eagle and drop != "all" else (),
            num_blocks=num_blocks, groups=tuple(_ours_spec(k, kw, spec_blocks) for k, kw in layout),
            hash_block_size=self.hash_block, enable_caching=caching, enable_kv_cache_events=True,
            max_model_len=8192, profile="vllm-0.33", num_hash_lookahead_tokens=self.lookahead,
            max_in_flight_tokens=BUDGET_033, scheduler_block_size=math.lcm(*sizes),
            prefix_cache_retention_interval=_retention(layout), needs_kv_cache_zeroing=zeroing))  # fmt: skip
        self.caching = caching
        #: the worker zeroes new blocks (vLLM 0.33: mamba layers, or needs_kv_cache_zeroing)
        self.zeroing = zeroing or any(kind.startswith("mamba") for kind, _ in layout)
        self.none = none_hash("sha256_cbor", "0", profile="vllm-0.33")
        self.hashers: dict[str, Any] = {}

    def add(self, rid: str, tokens: list[int], salt: str | None = None,
            lora: tuple[int, str] | None = None) -> Callable[[], None]:  # fmt: skip
        hashes: list[bytes] = []
        if self.caching:
            self.hashers[rid] = block_hasher(
                "vllm-0.33", "sha256_cbor", self.hash_block, self.none, cache_salt=salt,
                lora_name=lora[1] if lora else None, lora_path=f"loras/{lora[1]}" if lora else None,
                num_hash_lookahead_tokens=self.lookahead,
            )  # fmt: skip
            hashes = self.hashers[rid].extend(tokens)
        adapter = LoRA(*lora) if lora else None
        return lambda: self.pool.add_request(rid, tokens, hashes, lora=adapter, cache_salt=salt)

    def advance(self, rid: str, computed: int, appended: list[int]) -> Callable[[], None]:
        hasher = self.hashers.get(rid)
        hashes = hasher.extend(appended) if hasher is not None else []
        return lambda: self.pool.update_request(
            rid, num_computed_tokens=computed, append_token_ids=appended, append_block_hashes=hashes
        )

    def free(self, rid: str) -> None:
        self.pool.free(rid)
        self.hashers.pop(rid, None)

    def boundary(self, rid: str) -> int:
        return self.pool.shared_prefix_boundary(rid)

    def admit(self, rid: str, n: int, hit_tokens: int, hit: Any, lookahead: int) -> list[list[int]] | None:
        out = self.pool.allocate_slots(rid, n, hit_tokens, hit, lookahead, full_sequence_must_fit=True)
        return None if out is None else [list(x) for x in out]

    def grow(self, rid: str, n: int, lookahead: int) -> list[list[int]] | None:
        out = self.pool.allocate_slots(rid, n, num_lookahead_tokens=lookahead)
        return None if out is None else [list(x) for x in out]

    def record_stats(self, rid: str, hits: int) -> None:
        self.pool.record_prefix_cache_stats(rid, hits)

    def estimate(self, rid: str) -> int:
        return self.pool.estimate_cached_tokens(rid)

    def cache_blocks(self, rid: str, computed: int) -> None:
        self.pool.cache_blocks(rid, computed)

    def step_start(self) -> None:
        self.pool.new_step_starts()

    def reset(self) -> bool:
        return self.pool.reset_prefix_cache()

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(x) for x in self.pool.get_block_ids(rid)]

    def free_head(self, limit: int) -> list[int]:
        return self.pool.free_queue_head(limit)

    def stats(self) -> tuple[Any, ...]:
        return _stats_tuple(self.pool.make_prefix_cache_stats())

    def events(self) -> list[tuple[Any, ...]]:
        return [_event_tuple033(e) for e in self.pool.take_events()]


def zeroing_kv_cache_config() -> Any:
    """vLLM 0.33's ``KVCacheConfig`` with ``needs_kv_cache_zeroing`` on whatever the layers
    are: the value vLLM computes for a mixed-precision KV cache (attention layers of
    several dtypes) without building one (its managers read only the flag)."""
    from vllm.v1 import kv_cache_interface as k

    return type(
        "ZeroingKVCacheConfig", (k.KVCacheConfig,), {"needs_kv_cache_zeroing": property(lambda _: True)}
    )


class VLLM033(VLLM):
    """vLLM 0.33.0's own KVCacheManager, built as its Scheduler builds it for the same
    layout (EAGLE: look-ahead hashes with caching on, the last-block drop with caching
    off, one prefill look-ahead token, the first group holding the draft layer)."""

    def __init__(self, layout: list[tuple[str, dict[str, Any]]], num_blocks: int, eagle: bool,
                 caching: bool = True, drop: str = "", zeroing: bool = False) -> None:  # fmt: skip
        import torch
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1 import kv_cache_interface as k
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256_cbor)
        logging.getLogger("vllm").setLevel(logging.ERROR)  # its refused plain resets warn
        self.mamba_align = any(kind.startswith("mamba_align") for kind, _ in layout)
        self.sched_block = math.lcm(*_block_sizes(layout))
        common = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.float16}
        specs: list[Any] = []
        for kind, kw in layout:
            size = 32 if kind in ("full32", "swa32") else 16
            if kind in ("full", "full32"):
                specs.append(k.FullAttentionSpec(size, **common))
            elif kind == "mla":  # (one latent vector per token)
                specs.append(k.MLAAttentionSpec(size, num_kv_heads=1, head_size=576, dtype=torch.float16))
            elif kind in ("swa", "swa32"):
                specs.append(k.SlidingWindowSpec(size, sliding_window=kw["sliding_window"], **common))
            elif kind == "chunked":
                specs.append(k.ChunkedLocalAttentionSpec(size, attention_chunk_size=kw["attention_chunk_size"],
                                                         **common))  # fmt: skip
            elif kind in ("mamba_align", "mamba_align_ckpt"):
                # as vLLM sizes it: one speculative block per draft token (MTP/EAGLE)
                ckpt = int(kind == "mamba_align_ckpt")
                specs.append(k.MambaSpec(16, shapes=((8,),), dtypes=(torch.float16,), mamba_cache_mode="align",
                                         num_speculative_blocks=SPEC_TOKENS_033 if eagle else 0,
                                         num_prefill_checkpoint_blocks=ckpt,
                                         prefill_checkpoint_alignment=1 if ckpt else None))  # fmt: skip
            else:
                raise ValueError(f"layout kind {kind!r} has no vLLM 0.33 spec here")
        groups = [
            k.KVCacheGroupSpec([f"layer{i}"], s, is_eagle_group=eagle and i == 0 and drop != "all")
            for i, s in enumerate(specs)
        ]
        sizes = _block_sizes(layout)
        hash_block = math.gcd(*sizes)
        # zeroing: KVCacheConfig.needs_kv_cache_zeroing on (vLLM sets it for a mixed-precision
        # cache, :func:`zeroing_kv_cache_config`; with mamba layers it is on anyway)
        config_cls = zeroing_kv_cache_config() if zeroing else k.KVCacheConfig
        cfg = config_cls(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                              prefix_cache_retention_interval=_retention(layout),
                              hash_block_size=hash_block)  # fmt: skip
        self.zeroing = bool(cfg.needs_kv_cache_zeroing)
        lookahead = 1 if eagle and caching and not drop else 0
        self.m = KVCacheManager(
            cfg, max_model_len=8192, scheduler_block_size=math.lcm(*sizes), hash_block_size=hash_block,
            max_in_flight_tokens=BUDGET_033, enable_caching=caching, use_eagle=eagle and not lookahead,
            num_hash_lookahead_tokens=lookahead, num_prefill_lookahead=1 if eagle else 0, log_stats=True,
            enable_kv_cache_events=True,
        )  # fmt: skip
        hasher = get_request_block_hasher(hash_block, sha256_cbor, lookahead) if caching else None
        self._make033: Callable[..., Any] = lambda rid, toks, salt, lora: Request(
            rid, toks, SamplingParams(max_tokens=1000), None, block_hasher=hasher, cache_salt=salt,
            lora_request=LoRARequest(lora[1], lora[0], f"loras/{lora[1]}") if lora else None,
        )  # fmt: skip
        self.reqs: dict[str, Any] = {}

    def add(self, rid: str, tokens: list[int], salt: str | None = None,
            lora: tuple[int, str] | None = None) -> None:  # fmt: skip
        self.reqs[rid] = self._make033(rid, tokens, salt, lora)

    def lookup(self, rid: str) -> tuple[Any, list[list[int]], int]:
        r = self.reqs[rid]
        blocks, n, boundary = self.m.get_computed_blocks(r)
        r.shared_prefix_boundary = boundary  # as the Scheduler does, admitted or not
        return blocks, [list(x) for x in blocks.get_block_ids()], n

    def boundary(self, rid: str) -> int:
        return int(self.reqs[rid].shared_prefix_boundary)

    def admit(self, rid: str, n: int, hit_tokens: int, hit: Any, lookahead: int) -> list[list[int]] | None:
        out = self.m.allocate_slots(self.reqs[rid], n, hit_tokens, hit, num_lookahead_tokens=lookahead,
                                    full_sequence_must_fit=True)  # fmt: skip
        return None if out is None else [list(x) for x in out.get_block_ids(allow_none=False)]

    def grow(self, rid: str, n: int, lookahead: int) -> list[list[int]] | None:
        out = self.m.allocate_slots(self.reqs[rid], n, num_lookahead_tokens=lookahead)
        return None if out is None else [list(x) for x in out.get_block_ids(allow_none=False)]

    def record_stats(self, rid: str, hits: int) -> None:
        self.m.record_prefix_cache_stats(self.reqs[rid], hits)

    def estimate(self, rid: str) -> int:
        return int(self.m.estimate_cached_tokens(self.reqs[rid]))

    def cache_blocks(self, rid: str, computed: int) -> None:
        self.m.cache_blocks(self.reqs[rid], computed)

    def step_start(self) -> None:
        self.m.new_step_starts()

    def reset(self) -> bool:
        return bool(self.m.reset_prefix_cache())

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(x) for x in self.m.get_block_ids(rid)]

    def free_head(self, limit: int) -> list[int]:
        out: list[int] = []
        queue = self.m.block_pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        while block is not None and block is not queue.fake_free_list_tail and len(out) < limit:
            out.append(block.block_id)
            block = block.next_free_block
        return out

    def stats(self) -> tuple[Any, ...]:
        s = self.m.make_prefix_cache_stats()
        if s is not None and s.hits_by_source:
            raise SystemExit(f"vLLM's manager reported hits_by_source {s.hits_by_source}: not modelled here")
        return _stats_tuple(s)

    def events(self) -> list[tuple[Any, ...]]:
        return [_event_tuple033(e) for e in self.m.take_events()]


def _stats_tuple(s: Any) -> tuple[Any, ...]:
    assert s is not None
    return (
        s.reset,
        s.requests,
        s.queries,
        s.hits,
        s.preempted_requests,
        s.preempted_queries,
        s.preempted_hits,
    )


def _event_tuple033(event: Any) -> tuple[Any, ...]:
    """A KV event of either side with vLLM 0.33's fields; a field kvcoord does not have
    (locality, ownership, session_id) must be unset on vLLM's side too."""

    def h(x: Any) -> Any:
        return hash_to_int64(x) if isinstance(x, bytes) else x

    def keys(extra: Any) -> Any:
        return None if extra is None else tuple(None if e is None else tuple(e) for e in extra)

    unmodelled = tuple(getattr(event, f, None) for f in ("locality", "ownership", "session_id"))
    name = type(event).__name__
    if name == "BlockStored":
        look = event.lookahead_token_ids
        return (name, tuple(map(h, event.block_hashes)), h(event.parent_block_hash), tuple(event.token_ids),
                event.block_size, event.lora_id, event.medium, event.lora_name, keys(event.extra_keys),
                event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window,
                None if look is None else tuple(map(tuple, look)), unmodelled)  # fmt: skip
    if name == "BlockRemoved":
        return (name, tuple(map(h, event.block_hashes)), event.medium, event.group_idx, unmodelled)
    return (name,)


def _aligned_chunk(side: Any, start: int, n: int, prefill_end: int) -> int:
    """A mamba "align" layout's prefill chunk that stops before ``prefill_end`` ends on a
    block boundary (as vLLM 0.33's scheduler clips it; 0: nothing this step)."""
    if not side.mamba_align or start + n >= prefill_end:
        return n
    return (start + n) // 16 * 16 - start if (start + n) // 16 * 16 > start else 0


def schedule_running(
    side: Any, running: list[str], tokens: dict[str, list[int]], computed: dict[str, int],
    prompt_len: dict[str, int], spec_tokens: int, budget: int, rec: Callable[[Any], None],
    preempt: Callable[[str], None], chunk: Callable[[str, int, int], int],
) -> tuple[list[tuple[str, int, int]], int, bool]:  # fmt: skip
    """vLLM 0.33's running loop: each running request's next chunk (its drafts' slots
    with its last token), the newest request preempted until the oldest fits. Returns the
    scheduled (request, tokens, drafts), the budget left and whether any was preempted.
    ``chunk(rid, start, n)`` clips a chunk (0: nothing this step)."""
    scheduled: list[tuple[str, int, int]] = []
    preempted = False
    index = 0
    while index < len(running) and budget > 0:
        rid = running[index]
        left = len(tokens[rid]) - computed[rid]
        drafts = spec_tokens if left == 1 and len(tokens[rid]) > prompt_len[rid] else 0
        n = min(left + drafts, budget, 512)
        drafts = min(drafts, n - 1)
        n = chunk(rid, computed[rid], n)
        if n == 0:
            index += 1
            continue
        while True:
            new = side.grow(rid, n, spec_tokens)
            rec(("alloc", rid, new, side.num_free()))
            if new is not None:
                break
            victim = running.pop()
            preempted = True
            preempt(victim)
            if victim == rid:
                break
        if new is None:
            break
        scheduled.append((rid, n, drafts))
        budget -= n
        index += 1
    return scheduled, budget, preempted


def workload033(side: Any, seed: int, steps: int, trace: list[Any], spec_tokens: int) -> None:
    """vLLM 0.33's synchronous scheduler loop, reduced to its manager calls; appends every
    answer to ``trace``.

    Arrivals as in :func:`workload` (up to 24 live requests, 1-40 output tokens); a
    prompt is one of three shared system prompts and a random tail (a tenth of them
    with one of two cache salts, a tenth with one of two LoRA adapters), or a prompt
    sent before, or the next turn of a finished conversation (with the same salt and
    adapter). Each step:

    - ``new_step_starts``; now and then ``reset_prefix_cache``, plain (refused while
      blocks are in use) or after preempting every running request; now and then an
      abort (``free``) of a running or waiting request;
    - running requests first, in order: a chunk of their prefill or a decode step (with
      EAGLE, one token plus ``spec_tokens`` drafts and ``spec_tokens`` look-ahead slots);
      a refusal preempts the last running request and retries, until it fits or the
      request itself was preempted;
    - then, unless something was preempted, waiting requests in order: a lookup (its
      shared-prefix boundary kept on the request), an admission that must fit the whole
      sequence (``full_sequence_must_fit``; a refusal stops admissions for the step) and
      the statistics recorded at admission;
    - the outputs: a random number of drafts accepted and the rest rolled back; with
      EAGLE, ``cache_blocks`` after every sampled output; ``estimate_cached_tokens`` at
      a request's first output; finished requests freed.

    Recorded: hits and boundaries, new block ids or refusals, free counts, every running
    request's block table and the free queue's head once scheduled, each step's events
    and statistics.
    """
    rnd = random.Random(seed)
    systems = [[rnd.randrange(32000) for _ in range(n)] for n in (64, 200, 500)]
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    decode_left: dict[str, int] = {}
    prompt_len: dict[str, int] = {}
    running: list[str] = []
    waiting: list[str] = []
    request_keys: dict[str, tuple[str | None, tuple[int, str] | None]] = {}  # cache salt, LoRA
    history: list[tuple[list[int], Any]] = []  # prompts sent, with their keys
    finished: list[tuple[list[int], Any]] = []  # finished requests' prompts and outputs
    estimated: set[str] = set()
    nid = 0
    rec = trace.append

    def preempt(victim: str) -> None:
        side.preempt(victim)
        computed[victim] = 0
        waiting.insert(0, victim)  # back to the front of the queue, as vLLM does
        rec(("preempt", victim, side.num_free()))

    def finish(rid: str) -> None:
        side.free(rid)
        rec(("free", rid, side.num_free()))
        (running if rid in running else waiting).remove(rid)
        for d in (tokens, computed, decode_left, prompt_len, request_keys):
            del d[rid]

    def after_output(rid: str, new_computed: int, appended: list[int]) -> None:
        computed[rid] = new_computed
        tokens[rid].extend(appended)
        sync = side.advance(rid, new_computed, appended)
        if sync is not None:
            sync()
        if spec_tokens and appended:
            side.cache_blocks(rid, new_computed)
            rec(("cached", rid, side.num_free()))

    for _ in range(steps):
        side.step_start()
        if rnd.random() < 0.03:
            if rnd.random() < 0.5:
                while running:
                    preempt(running.pop())
            rec(("reset", side.reset(), side.num_free()))
        if tokens and rnd.random() < 0.05:  # an abort, running or waiting
            finish(rnd.choice(sorted(tokens)))
        while len(tokens) < 24 and rnd.random() < 0.7:
            rid = f"r{nid}"
            nid += 1
            pick = rnd.random()
            if pick < 0.15 and history:  # the same prompt again
                toks, keys = rnd.choice(history)
            elif pick < 0.35 and finished:  # the next turn of a finished conversation
                toks, keys = rnd.choice(finished)
                toks = (toks + [rnd.randrange(32000) for _ in range(rnd.randint(1, 100))])[:1400]
            else:
                toks = rnd.choice(systems) + [rnd.randrange(32000) for _ in range(rnd.randint(1, 700))]
                toks = toks[:1200]
                salt = rnd.choice(("salt-a", "salt-b")) if rnd.random() < 0.1 else None
                keys = (salt, rnd.choice(LORAS_033) if rnd.random() < 0.1 else None)
            history.append((toks, keys))
            tokens[rid], computed[rid], decode_left[rid] = list(toks), 0, rnd.randint(1, 40)
            prompt_len[rid] = len(toks)
            request_keys[rid] = keys
            waiting.append(rid)
            sync = side.add(rid, list(toks), *keys)
            if sync is not None:
                sync()
        budget = BUDGET_033
        scheduled, budget, preempted = schedule_running(
            side, running, tokens, computed, prompt_len, spec_tokens, budget, rec, preempt,
            lambda rid, start, n: _aligned_chunk(side, start, n, max(prompt_len[rid], len(tokens[rid]) - 1)),
        )  # fmt: skip
        while waiting and budget > 0 and not preempted:
            rid = waiting[0]
            hit, ids, n_hit = side.lookup(rid)
            rec(("hit", rid, ids, n_hit, side.boundary(rid)))
            n = min(len(tokens[rid]) - n_hit, budget, 512)
            n = _aligned_chunk(side, n_hit, n, max(prompt_len[rid], len(tokens[rid]) - 1))
            if n == 0:
                break
            new = side.admit(rid, n, n_hit, hit, spec_tokens)
            rec(("admit", rid, new, side.num_free()))
            if new is None:
                break
            side.record_stats(rid, n_hit)
            waiting.pop(0)
            running.append(rid)
            computed[rid] = n_hit
            scheduled.append((rid, n, 0))
            budget -= n
        for rid in running:
            rec(("blocks", rid, side.block_ids(rid)))
        rec(("free queue", side.free_head(8)))
        # the model ran: outputs
        for rid, n, drafts in scheduled:
            if rid not in running:
                continue
            done = computed[rid] + n - drafts
            if done < len(tokens[rid]):  # a prefill chunk: no output
                after_output(rid, done, [])
                continue
            first = rid not in estimated  # its first output reports its cached tokens
            estimated.add(rid)
            if decode_left[rid] <= 0:
                if first:
                    rec(("estimate", rid, side.estimate(rid)))
                finished.append((tokens[rid], request_keys[rid]))
                finish(rid)
                continue
            accepted = rnd.randint(0, drafts)
            decode_left[rid] -= 1 + accepted
            after_output(rid, done + accepted, [rnd.randrange(32000) for _ in range(1 + accepted)])
            if first:
                rec(("estimate", rid, side.estimate(rid)))
        rec(("events", side.events()))
        rec(("stats", side.stats()))


def check033(seeds: int, steps: int, layouts: dict[str, list[tuple[str, dict[str, Any]]]] | None = None,
             out: Callable[[str], None] = print) -> dict[str, int]:  # fmt: skip
    """The differential check against vLLM 0.33.0: every layout with prefix caching on and
    off and EAGLE on and off, ``seeds`` seeds each. Raises :class:`Difference` at the first
    differing answer; returns the number of answers compared per layout."""
    counts: dict[str, int] = {}
    for name, layout in (LAYOUTS_033 if layouts is None else layouts).items():
        counts[name] = 0
        for caching in (True, False):
            # EAGLE: with caching on look-ahead hashes (eagle=True) or, as with a KV connector
            # or disable_lookahead_block_hashes, the trailing-block drop in the first group
            # (the draft's, drop=first) or in every group (none flagged, drop=all); with
            # caching off the drop (nothing is looked up)
            modes = [(False, ""), (True, "")] + ([(True, "first"), (True, "all")] if caching else [])
            for eagle, drop in modes:
                label = f"eagle={eagle}" + (f" drop={drop}" if drop else "")
                try:
                    Ours033(layout, 2, eagle, caching, drop)
                except ConfigError as exc:
                    # EAGLE's drop beside a mamba group (it moves 0.33's mamba checkpoints
                    # back a block) and a window of another block size than the LCM: the
                    # vllm-0.33 profile refuses them, and the plug-in too
                    out(f"skipped    {name} caching={caching} {label}: refused ({exc})")
                    continue
                for seed in range(seeds):
                    num_blocks = 300 + 200 * seed
                    spec = SPEC_TOKENS_033 if eagle else 0
                    a: list[Any] = []
                    b: list[Any] = []
                    workload033(VLLM033(layout, num_blocks, eagle, caching, drop), seed, steps, a, spec)
                    workload033(Ours033(layout, num_blocks, eagle, caching, drop), seed, steps, b, spec)
                    where = f"{name} caching={caching} {label} seed={seed} blocks={num_blocks}"
                    compare(where, a, b)
                    counts[name] += len(a)
                    out(f"identical  {where}: {len(a)} answers ({_coverage(a)})")
    return counts


def _coverage(trace: list[Any]) -> str:
    """What a run exercised: lookups that hit, refused allocations and admissions,
    preemptions, resets that succeeded, KV events."""
    kinds = [x[0] for x in trace]
    hits = sum(1 for x in trace if x[0] == "hit" and x[3] > 0)
    refused = sum(1 for x in trace if x[0] in ("alloc", "admit") and x[2] is None)
    resets = sum(1 for x in trace if x[0] == "reset" and x[1])
    events = sum(len(x[1]) for x in trace if x[0] == "events")
    return (f"{hits}/{kinds.count('hit')} lookups hit, {refused} refusals, {kinds.count('preempt')} "
            f"preemptions, {resets}/{kinds.count('reset')} resets, {events} events")  # fmt: skip


class Difference(AssertionError):
    """vLLM and kvcoord answered differently."""


def compare(where: str, a: list[Any], b: list[Any]) -> None:
    """Raise :class:`Difference` naming the first answer where vLLM's ``a`` and kvcoord's
    ``b`` differ."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            raise Difference(f"DIFFERENCE {where} at answer {i}: vLLM {x} vs ours {y}")
    if len(a) != len(b):
        raise Difference(f"DIFFERENCE {where}: {len(a)} vs {len(b)} answers")


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
    parser.add_argument("--layouts", nargs="*", help="vLLM 0.33: only these layouts (names as printed)")
    parser.add_argument("--vllm", choices=("auto", "0.16", "0.33"), default="auto",
                        help="the vLLM release to compare with (auto: the installed one)")  # fmt: skip
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("run with PYTHONHASHSEED=0 so that vLLM's NONE_HASH is the seeded one")
    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("vLLM is not installed here; see this file's docstring") from None
    release = ".".join(installed.split(".")[:2])
    if release not in ("0.16", "0.33") or args.vllm not in ("auto", release):
        raise SystemExit(f"vLLM {installed} is installed; this compares with 0.16.x or 0.33.x "
                         f"(--vllm {args.vllm}): use the venv of scripts/install_vllm.sh")  # fmt: skip
    if release == "0.33":
        if args.skip_check:
            raise SystemExit("vLLM 0.33: there is only the differential check (no timings yet)")
        try:
            chosen = {k: v for k, v in LAYOUTS_033.items() if not args.layouts or k in args.layouts}
            counts = check033(args.seeds, args.steps, chosen)
        except Difference as exc:
            raise SystemExit(str(exc)) from None
        for name, n in counts.items():
            print(f"{name:<31} {n:>9} answers")
        print(f"differential check: {sum(counts.values())} answers identical to vLLM {installed}")
        if not args.check_only:
            print("timings: measured against vLLM 0.16.0 only (run this in its venv)")
        return
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
                try:
                    compare(f"{name} eagle={eagle} seed={seed}", a, b)
                except Difference as exc:
                    raise SystemExit(str(exc)) from None
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
