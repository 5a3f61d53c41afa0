"""kvcoord's engine against vLLM's own KVCacheManager with KV-connector tokens. Not a test.

bench/vs_vllm.py's differential check never passes ``num_external_computed_tokens`` (tokens
a KV connector loads beyond the local prefix hit) nor ``delay_cache_blocks`` (an
asynchronous load). This one does, on the same layouts and with the same managers (built
by bench/vs_vllm.py's classes; vLLM 0.16.x or 0.33.x, whichever the venv has):

    PYTHONHASHSEED=0 /var/cache/kvcoord/vllm-venv/bin/python bench/vs_vllm_connector.py \
        [--seeds 3] [--steps 150] [--first-seed 0] [--layouts full16 ...]
    PYTHONHASHSEED=0 /var/cache/kvcoord/vllm033-venv/bin/python bench/vs_vllm_connector.py ...

The workload (:func:`workload`) is vLLM's scheduler loop reduced to its manager calls:
running requests first (a prefill chunk or a decode step; a refusal preempts the last
running request and retries), then waiting requests in order. A waiting request with no
computed tokens looks up its prefix; half the time a connector then reports external
tokens, a random count from 1 to what the prompt has left minus one (the local hit plus
the external tokens reach the whole prompt only in 0.33's whole-sequence loads below; a third of the counts are rounded so
that hit + external ends on a block boundary). Of those, 40% load asynchronously: the
first allocation takes slots for the hit and the external tokens only
(``delay_cache_blocks=True``, no look-ahead slots), the request waits one or two steps and
then, when the waiting scan reaches it, the scheduler calls ``cache_blocks(request, hit +
external)`` and schedules it as a waiting request with computed tokens (no lookup;
under 0.33 a tenth of the asynchronous loads cover the whole sequence: it caches every
token, then computes the last one again). The
others load synchronously: the first allocation adopts the hit, takes the external
tokens' blocks and the first chunk's, and caches. Where the layout has one group, a
fifth of the loads fail at one of the blocks they loaded (a connector's
``invalid_block_ids``; vLLM maps them to requests with one group only). An asynchronous
one caches and computes from that block's start when it lands; at block 0 (no local hit)
the scheduler frees its blocks and the same scan looks its prefix up and allocates
again (under 0.33 a tenth of the asynchronous loads, any layout, also fail as a whole,
``failed_recving``, with the same outcome). A synchronous one is found in the step's
output (vLLM's scan of the running requests, later ones sharing the block going back to
their start): with the "recompute" policy the request computes from that block again,
its output dropped; with "fail" (three runs in ten) the blocks from there on are evicted
and the request freed after the step's outputs.
Under 0.16 with one group a landed load counts its blocks' tokens (at most the prompt
less one), as 0.16's scheduler does; under 0.33 an asynchronous first allocation keeps
0-8 blocks free for other loads in flight (``reserved_blocks``). Aborts (running,
waiting or loading)
happen now and then; under 0.33 also vLLM 0.33's admission gate
(``full_sequence_must_fit``), statistics at admission, ``estimate_cached_tokens``, EAGLE's
drafts, resets, salts and LoRA adapters, as bench/vs_vllm.py's ``workload033`` has them.

Under 0.33 also the worker's block zeroing: every other run zeroes new blocks
(``needs_kv_cache_zeroing``, which vLLM sets for a mixed-precision cache; mamba layouts
always). Each step's new block ids (``take_new_block_ids``, what the scheduler puts in
its output) are compared; an asynchronous first allocation passes the groups its load
writes as ``skip_zeroing_group_ids`` (every group, some or none); an asynchronous load
that failed part way caches its valid tokens, then records the blocks past them again
(``record_blocks_for_zeroing``). And a run in three without mamba has a prefix replay
window of :data:`REPLAY_033` tokens (0.33's ``prefix_replay_tokens``, which only a
DeepSeek-V4.1 bounded-replay window group sets; kvcoord's plug-in refuses that group, so
here it is the scheduler's arithmetic on the layout's own groups, the manager's answers
still vLLM's): external tokens rounded down to the scheduler block, hits of at most the
window dropped, a fresh synchronous admission rewound by ``min(window, hit)`` and
allocating slots past the hit only (none for a chunk inside the replayed tokens), a
landed load replaying its window. A quarter of those runs' synchronous loads cover the
whole sequence (half their prompts end on a scheduler block, so some stay whole): the
first allocation adopts the hit and the whole rest as external tokens with no new slot,
and the window is computed again. (Without a replay window vLLM 0.33's scheduler cannot
take such a load: ``assert num_new_tokens > 0`` in ``schedule``.)

Pools of 400, 600, 800 or 1,000 blocks under 0.16 and 300, 500, 700 or 900 under 0.33
(by seed), or ``--blocks N``; the layouts are bench/vs_vllm.py's for the release and
:data:`EXTRA_LAYOUTS` (a window or mamba group before full attention).

Compared (bench/vs_vllm.py's ``compare``, the first difference stops the run): hits
(and 0.33's shared-prefix boundaries), new block ids and refusals, free counts after each
call, every running or loading request's block table (per group) and the free queue's
head after each step's scheduling, 0.33's block ids to zero after it, each step's KV
events and prefix-cache statistics;
and kvcoord's pool passes ``check_pool`` after every step.

Where kvcoord raises :class:`~kvcoord.engine.HitBlockTakenError` or
:class:`~kvcoord.engine.UncountedBlocksError`, vLLM's side must have done the anomaly the
error names on the same call: after vLLM's allocation one block is in two groups'
tables (the same blocks the error names), or vLLM's allocation raised ``ValueError``
("Cannot get ... free blocks") half way. Both sides record the anomaly and drop the
request; nothing after that is comparable (vLLM's free queue and cache now differ from
the unchanged pool's), so both sides start again from fresh managers with the next seed
of the run (``restart`` in the output) for the steps left.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vs_vllm as base  # noqa: E402
from kvcoord.engine import ConfigError, HitBlockTakenError, UncountedBlocksError  # noqa: E402
from kvcoord.engine.invariants import check_pool  # noqa: E402

#: chance that a waiting request's first allocation gets external tokens, and that such
#: a load is asynchronous
P_EXTERNAL = 0.5
P_ASYNC = 0.4


class Anomaly(Exception):
    """A side did what kvcoord refuses loudly: ``kind`` is "shared" (one block in two
    groups' tables; ``blocks`` names them) or "uncounted" (vLLM ran out of blocks half way)."""

    def __init__(self, kind: str, blocks: tuple[int, ...] = ()) -> None:
        super().__init__(kind, blocks)
        self.kind, self.blocks = kind, blocks


def _shared(tables: list[list[int]]) -> tuple[int, ...]:
    """Block ids (the null block 0 aside) in more than one group's table."""
    seen: dict[int, set[int]] = {}
    for gid, table in enumerate(tables):
        for bid in table:
            if bid:
                seen.setdefault(bid, set()).add(gid)
    return tuple(sorted(b for b, groups in seen.items() if len(groups) > 1))


class _OursMixin:
    """kvcoord's side: its two loud refusals become :class:`Anomaly`; ``check`` runs the
    pool's invariant check."""

    pool: Any
    hashers: dict[str, Any]

    def _first(self, rid: str, n: int, hit_tokens: int, hit: Any, look: int, ext: int, delay: bool,
               **more: Any) -> list[list[int]] | None:  # fmt: skip
        try:
            out = self.pool.allocate_slots(rid, n, hit_tokens, hit, look, ext, delay, **more)
        except HitBlockTakenError as exc:
            named = {int(b) for b in re.findall(r"block (\d+) \(", str(exc))}
            raise Anomaly("shared", tuple(sorted(named))) from exc
        except UncountedBlocksError as exc:
            raise Anomaly("uncounted") from exc
        return None if out is None else [list(x) for x in out]

    def num_groups(self) -> int:
        return len(self.pool.managers)

    def drop_load(self, rid: str) -> None:
        """vLLM's ``free(request)`` of a request kept waiting (its load failed with no
        valid token): the plug-in's path, the pool forgets it and the next lookup
        registers it again, with its tokens, hashes and preemption count."""
        r = self.pool.get_request(rid)
        hasher = self.hashers.get(rid)
        self.pool.free(rid)
        self.pool.add_request(
            rid, list(r.all_token_ids), list(r.block_hashes), lora=r.lora, num_preemptions=r.num_preemptions,
            cache_salt=r.cache_salt, num_prompt_tokens=r.num_prompt_tokens or None,
        )  # fmt: skip
        if hasher is not None:
            self.hashers[rid] = hasher

    def evict(self, block_ids: set[int]) -> None:
        self.pool.evict_blocks(block_ids)

    def check(self) -> None:
        violations = check_pool(self.pool).violations
        if violations:
            raise base.Difference(f"kvcoord's pool fails check_pool: {violations}")


class _VLLMMixin:
    """vLLM's side: after a first allocation with external tokens, a block in two groups'
    tables or a ``ValueError`` half way becomes :class:`Anomaly`."""

    m: Any
    reqs: dict[str, Any]

    def _first(self, rid: str, n: int, hit_tokens: int, hit: Any, look: int, ext: int, delay: bool,
               **more: Any) -> list[list[int]] | None:  # fmt: skip
        try:
            out = self.m.allocate_slots(self.reqs[rid], n, hit_tokens, hit, look, ext, delay, **more)
        except ValueError as exc:
            # out of blocks half way: the request is left holding part of its table
            if ext and str(exc).startswith("Cannot get") and any(self.m.get_block_ids(rid)):
                raise Anomaly("uncounted") from exc
            raise
        if ext:
            shared = _shared([list(x) for x in self.m.get_block_ids(rid)])
            if shared:
                raise Anomaly("shared", shared)
        return None if out is None else [list(x) for x in out.get_block_ids(allow_none=False)]

    def num_groups(self) -> int:
        return len(self.m.coordinator.single_type_managers)

    def drop_load(self, rid: str) -> None:
        self.m.free(self.reqs[rid])  # the request stays (computed tokens already 0)

    def evict(self, block_ids: set[int]) -> None:
        self.m.evict_blocks(block_ids)

    def check(self) -> None:
        pass


class _Calls16:
    """vLLM 0.16's calls on either side (no look-ahead slots, no reserved blocks)."""

    release = "0.16"
    _first: Any
    allocate: Any

    def first(self, rid: str, n: int, hit_tokens: int, hit: Any, look: int, ext: int, delay: bool,
              reserved: int, skip_zeroing: tuple[int, ...] = ()) -> list[list[int]] | None:  # fmt: skip
        return self._first(rid, n, hit_tokens, hit, look, ext, delay)

    def grow(self, rid: str, n: int, look: int) -> list[list[int]] | None:
        return self.allocate(rid, n)

    resume = grow


class Ours16(_Calls16, _OursMixin, base.Ours):
    block_ids = base.Ours033.block_ids
    free_head = base.Ours033.free_head
    cache_blocks = base.Ours033.cache_blocks

    def stats(self) -> tuple[Any, ...]:
        return base._stats_tuple(self.pool.make_prefix_cache_stats())


class VLLM16(_Calls16, _VLLMMixin, base.VLLM):
    block_ids = base.VLLM033.block_ids
    free_head = base.VLLM033.free_head
    cache_blocks = base.VLLM033.cache_blocks

    def stats(self) -> tuple[Any, ...]:
        return base._stats_tuple(self.m.make_prefix_cache_stats())


class _Calls33:
    """vLLM 0.33's calls on either side (admissions that must fit the whole sequence,
    reserved blocks)."""

    release = "0.33"
    _first: Any
    admit: Any

    def first(self, rid: str, n: int, hit_tokens: int, hit: Any, look: int, ext: int, delay: bool,
              reserved: int, skip_zeroing: tuple[int, ...] = ()) -> list[list[int]] | None:  # fmt: skip
        return self._first(rid, n, hit_tokens, hit, look, ext, delay, full_sequence_must_fit=True,
                           reserved_blocks=reserved, skip_zeroing_group_ids=skip_zeroing)  # fmt: skip

    def resume(self, rid: str, n: int, look: int) -> list[list[int]] | None:
        return self.admit(rid, n, 0, None, look)


class Ours33(_Calls33, _OursMixin, base.Ours033):
    def take_zeroing(self) -> list[int]:
        """The new blocks' ids for the worker to zero (``take_new_block_ids``; a pool that
        does not zero answers an empty list)."""
        return list(self.pool.take_new_block_ids())

    def record_zeroing(self, rid: str, start_token: int) -> None:
        self.pool.record_blocks_for_zeroing(rid, start_token)


class VLLM33(_Calls33, _VLLMMixin, base.VLLM033):
    def take_zeroing(self) -> list[int]:
        """What vLLM 0.33's scheduler hands its workers to zero each step
        (``_get_new_block_ids_to_zero``: the manager's ``take_new_block_ids``, nothing
        when the cache needs no zeroing)."""
        ids = list(self.m.take_new_block_ids())
        return ids if self.zeroing else []

    def record_zeroing(self, rid: str, start_token: int) -> None:
        self.m.record_blocks_for_zeroing(rid, start_token)


#: layouts beside bench/vs_vllm.py's with another group before full attention (a group
#: adopting the external tokens first takes blocks from the free queue's head before the
#: full attention group touches its hit)
EXTRA_LAYOUTS = {
    "0.16": {
        "swa16(w128)+full16": [("swa", {"sliding_window": 128}), ("full", {})],
        "mamba16(all)+full16": [("mamba", {}), ("full", {})],
    },
    "0.33": {
        "swa16(w128)+full16": [("swa", {"sliding_window": 128}), ("full", {})],
        "mamba16(align)+full16": [("mamba_align", {}), ("full", {})],
    },
}


def layouts(release: str) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """bench/vs_vllm.py's layouts of ``release`` and :data:`EXTRA_LAYOUTS`."""
    return {**(base.LAYOUTS if release == "0.16" else base.LAYOUTS_033), **EXTRA_LAYOUTS[release]}


#: chance that a load fails part way (one-group layouts only: vLLM's scheduler maps
#: invalid block ids to requests with one group only; 0.16 raises on more, 0.33 refuses)
P_FAILED_LOAD = 0.2
#: 0.33: chance that an asynchronous load is reported failed as a whole
#: (``failed_recving``, any layout)
P_LOAD_LOST = 0.1
#: 0.33: chance that an asynchronous load covers the whole sequence (the scheduler caches
#: every token once it lands, then computes the last one again)
P_WHOLE_PROMPT = 0.1
#: runs with a prefix replay window: chance that a synchronous load covers the whole
#: sequence (the scheduler then computes the replayed window only)
P_WHOLE_SYNC = 0.25
#: 0.33: the prefix replay window of the runs that have one (the window of a
#: DeepSeek-V4.1 bounded-replay sliding-window group, 128 tokens)
REPLAY_033 = 128
#: chance that a run uses vLLM's ``kv_load_failure_policy="fail"`` (else "recompute")
P_FAIL_POLICY = 0.3


def _landed(side: Any, rnd: random.Random, rid: str, hit: int, end: int, num_tokens: int,
            replay: int = 0) -> tuple[int, bool]:  # fmt: skip
    """The tokens a landed asynchronous load counts as computed (and caches), as vLLM's
    scheduler decides them: 0.33 the hit and the external tokens; 0.16 with one group its
    blocks' tokens (``len(block_ids) * block_size``, at most the request's tokens less
    one). With one group a load fails now and then at one of its external blocks (both
    releases then compute from that block's start); under 0.33 a whole load is now and
    then reported failed (``failed_recving``, any layout). 0 tokens: the scheduler frees
    the request's blocks and keeps it waiting (it looks its prefix up again at once).

    With a ``replay`` window no load fails leaving 1 to ``replay`` valid tokens: the
    window's replay would rewind it to 0 computed tokens while it holds its blocks, and
    vLLM 0.33's next scan would look its prefix up again as a new request's (its
    coordinator asserts when that lookup hits): a case not modelled here."""
    groups = side.num_groups()
    if groups == 1 and side.release == "0.16":
        end = min(-(-end // 16) * 16, num_tokens)
        end -= end == num_tokens
    if side.release == "0.33" and rnd.random() < P_LOAD_LOST:
        return 0, True
    if groups == 1 and rnd.random() < P_FAILED_LOAD:
        # a block the connector loaded (not one a window skipped: the null block)
        table = side.block_ids(rid)[0]
        first_bad = [i for i in range(hit // 16, -(-end // 16)) if table[i] and not 0 < i * 16 <= replay]
        if first_bad:  # a third at the first block loaded (block 0 without a local hit)
            bad = first_bad[0] if rnd.random() < 1 / 3 else rnd.choice(first_bad)
            return min(end, bad * 16), True
    return end, False


def _replay_admission(block: int, replay: int, n_hit: int, hit: Any, ext: int, delay: bool) -> tuple[int, Any, int, bool, int]:  # fmt: skip
    """vLLM 0.33's scheduler with a prefix replay window of ``replay`` tokens
    (``prefix_replay_tokens``, DeepSeek-V4.1's bounded-replay sliding window; one the
    connector's load never restores), on a fresh admission: external tokens rounded
    down to its block (``block``, the scheduler's), a load left empty made
    synchronous; a hit of at most ``replay`` tokens (local and external) dropped whole;
    a synchronous admission replays the hit's last ``min(replay, hit)`` tokens
    (``_mark_prefix_replay``: computed tokens rewound by that much, the allocation
    asking for slots past the hit only). Returns the hit tokens, the hit, the external
    tokens, whether the load is asynchronous and the tokens replayed."""
    ext -= ext % block
    delay = delay and ext > 0
    if 0 < n_hit + ext <= replay:
        return 0, None, 0, False, 0
    return n_hit, hit, ext, delay, 0 if delay else min(replay, n_hit + ext)


def _loaded_groups(rnd: random.Random, groups: int) -> tuple[int, ...]:
    """An asynchronous load's ``skip_zeroing_group_ids``: the groups the connector's load
    writes (``get_loaded_kv_cache_group_ids``; by default every prefix-cacheable group,
    here every group 60% of the time, some 30%, none 10%)."""
    pick = rnd.random()
    if pick < 0.6:
        return tuple(range(groups))
    if pick < 0.9:
        return tuple(sorted(rnd.sample(range(groups), rnd.randint(1, groups))))
    return ()


def _invalid_blocks(side: Any, order: list[str], reach: dict[str, int], invalid: set[int]) -> tuple[dict[str, int], set[int]]:  # fmt: skip
    """vLLM's scan of running requests for a step's invalid blocks (one group): the first
    request (in ``order``) holding an invalid block within its first ``reach`` tokens'
    blocks computes from that block's start again and the blocks from there on are to
    be evicted; a request whose invalid blocks were all marked by an earlier one goes
    back to its ``reach``. Returns the affected requests' computed tokens, and the
    blocks to evict."""
    marked: set[int] = set()
    affected: dict[str, int] = {}
    evict: set[int] = set()
    for rid in order:
        table = side.block_ids(rid)[0]
        hit_any = mine = False
        for idx, bid in zip(range(-(-reach[rid] // 16)), table, strict=False):
            if bid not in invalid:
                continue
            hit_any = True
            if bid in marked:
                continue
            marked.add(bid)
            if not mine:
                mine = True
                affected[rid] = idx * 16
                evict.update(table[idx:])
        if hit_any and not mine:
            affected[rid] = reach[rid]
    return affected, evict


def workload(
    make: Callable[[], Any], seed: int, steps: int, trace: list[Any], spec_tokens: int, replay: int = 0
) -> dict[str, int]:
    """The scheduler loop with a KV connector (see the module docstring); appends every
    answer to ``trace`` and returns what it exercised. ``make`` builds a fresh side (at
    the start and after each anomaly). ``replay``: 0.33's prefix replay window
    (``Scheduler.prefix_replay_tokens``, see :func:`_replay_admission`), 0 for none."""
    counts = {"external": 0, "async": 0, "cached": 0, "failed": 0, "dropped": 0, "sync failed": 0, "whole": 0,
              "refused": 0, "restarts": 0, "zeroed": 0, "zeroing recorded": 0, "skip zeroing": 0, "whole sync": 0,
              "replayed": 0, "replay dropped": 0, "inside replay": 0}  # fmt: skip
    left = steps
    attempt = 0
    while left > 0:
        left = _run(make(), random.Random(seed * 1000 + attempt), left, trace, spec_tokens, counts, replay)
        attempt += 1
        counts["restarts"] += left > 0
    return counts


def _run(side: Any, rnd: random.Random, steps: int, trace: list[Any], spec_tokens: int,
         counts: dict[str, int], replay: int = 0) -> int:  # fmt: skip
    """Run until ``steps`` steps are done or an anomaly: returns the steps left."""
    v033 = side.release == "0.33"
    if v033:
        trace.append(("zeroing", side.zeroing))
    systems = [[rnd.randrange(32000) for _ in range(n)] for n in (64, 200, 500)]
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    decode_left: dict[str, int] = {}
    prompt_len: dict[str, int] = {}
    loading: dict[str, int] = {}  # asynchronous loads: steps until the load lands
    load_end: dict[str, int] = {}  # their hit + external tokens
    hits: dict[str, int] = {}  # their local hits
    loaded: dict[str, int] = {}  # loads that landed: the tokens cached, computed from there
    running: list[str] = []
    waiting: list[str] = []
    keys: dict[str, Any] = {}
    history: list[tuple[list[int], Any]] = []
    finished: list[tuple[list[int], Any]] = []
    estimated: set[str] = set()
    sync_loads: dict[str, tuple[int, int]] = {}  # this step's synchronous loads: hit, external
    first_cached: dict[str, int] = {}  # 0.16's num_cached_tokens (set once, never reset)
    fail_policy = rnd.random() < P_FAIL_POLICY
    nid = 0
    rec = trace.append
    mamba_align = getattr(side, "mamba_align", False)

    def sync(fn: Any) -> None:
        if fn is not None:
            fn()

    def preempt(victim: str) -> None:
        side.preempt(victim)
        computed[victim] = 0
        waiting.insert(0, victim)
        rec(("preempt", victim, side.num_free()))

    def finish(rid: str) -> None:
        side.free(rid)
        rec(("free", rid, side.num_free()))
        (running if rid in running else waiting).remove(rid)
        for d in (loading, load_end, loaded, hits, first_cached):
            d.pop(rid, None)
        for d in (tokens, computed, decode_left, prompt_len, keys):
            del d[rid]

    def after_output(rid: str, new_computed: int, appended: list[int]) -> None:
        computed[rid] = new_computed
        tokens[rid].extend(appended)
        sync(side.advance(rid, new_computed, appended))
        if spec_tokens and appended:
            side.cache_blocks(rid, new_computed)
            rec(("cached", rid, side.num_free()))

    def chunk(rid: str, start: int, n: int) -> int:
        if not mamba_align:
            return n
        return base._aligned_chunk(side, start, n, max(prompt_len[rid], len(tokens[rid]) - 1))

    for step in range(steps):
        if v033:
            side.step_start()
            if rnd.random() < 0.03:
                if rnd.random() < 0.5:
                    while running:
                        preempt(running.pop())
                rec(("reset", side.reset(), side.num_free()))
        if tokens and rnd.random() < 0.05:  # an abort: running, waiting or loading
            finish(rnd.choice(sorted(tokens)))
        for rid in loading:
            loading[rid] -= 1
        while len(tokens) < 24 and rnd.random() < 0.7:
            rid = f"r{nid}"
            nid += 1
            pick = rnd.random()
            if pick < 0.15 and history:
                toks, k = rnd.choice(history)
            elif pick < 0.35 and finished:
                toks, k = rnd.choice(finished)
                toks = (toks + [rnd.randrange(32000) for _ in range(rnd.randint(1, 100))])[:1400]
            else:
                tail = [rnd.randrange(32000) for _ in range(rnd.randint(1, 700))]
                toks = (rnd.choice(systems) + tail)[:1200]
                salt = rnd.choice(("salt-a", "salt-b")) if v033 and rnd.random() < 0.1 else None
                k = (salt, rnd.choice(base.LORAS_033) if v033 and rnd.random() < 0.1 else None)
            if replay and len(toks) >= 32 and rnd.random() < 0.5:
                # (a whole-sequence load ends on a scheduler block: only such loads keep it whole)
                toks = toks[: len(toks) // side.sched_block * side.sched_block]
            history.append((toks, k))
            tokens[rid], computed[rid], decode_left[rid] = list(toks), 0, rnd.randint(1, 40)
            prompt_len[rid], keys[rid] = len(toks), k
            waiting.append(rid)
            sync(side.add(rid, list(toks), *k) if v033 else side.add(rid, list(toks)))
        budget = base.BUDGET_033
        scheduled, budget, preempted = base.schedule_running(
            side, running, tokens, computed, prompt_len, spec_tokens, budget, rec, preempt, chunk
        )
        index = 0
        while index < len(waiting) and budget > 0 and not preempted:
            rid = waiting[index]
            if rid in loading:
                if loading[rid] > 0:
                    index += 1  # still loading: skipped this step
                    continue
                # the load landed: cache what it wrote, then schedule from there
                del loading[rid]
                done, failed = _landed(
                    side, rnd, rid, hits.pop(rid), load_end.pop(rid), len(tokens[rid]), replay
                )
                counts["failed"] += failed
                computed[rid] = done
                if v033:  # 0.33 rolls a failed load's computed tokens back first; 0.16 sets them after
                    sync(side.advance(rid, done, []))
                if done:
                    loaded[rid] = done
                    side.cache_blocks(rid, done)
                    counts["cached"] += 1
                    if failed and v033 and side.zeroing:
                        # the failed load left the blocks past its valid tokens unwritten
                        side.record_zeroing(rid, done)
                        rec(("zeroing recorded", rid, done))
                        counts["zeroing recorded"] += 1
                    # 0.33 replays the window of a load (failed or not) that did not restore
                    # it; without one, a load of the whole sequence computes the last token again
                    back = min(replay, done) if replay else int(done == len(tokens[rid]))
                    if back:
                        counts["whole"] += done == len(tokens[rid])
                        counts["replayed"] += bool(replay)
                        done = loaded[rid] = computed[rid] = done - back
                        assert done > 0, "a replay rewound a landed load to 0 tokens (see _landed)"
                        sync(side.advance(rid, done, []))
                else:  # no valid token: blocks freed, the request waits on and looks up again
                    side.drop_load(rid)
                    counts["dropped"] += 1
                if not v033:
                    sync(side.advance(rid, done, []))
                rec(("landed", rid, done, side.num_free()))
            if rid in loaded:
                start = loaded[rid]
                n = chunk(rid, start, min(len(tokens[rid]) - start, budget, 512))
                if n == 0:
                    break
                new = side.resume(rid, n, spec_tokens)
                rec(("resume", rid, new, side.num_free()))
                if new is None:
                    counts["refused"] += 1
                    break
                del loaded[rid]
            else:
                hit, ids, n_hit = side.lookup(rid)
                rec(("hit", rid, ids, n_hit, side.boundary(rid) if v033 else 0))
                room = len(tokens[rid]) - n_hit - 1
                ext = 0
                if room >= 1 and rnd.random() < P_EXTERNAL:
                    ext = rnd.randint(1, room)
                    if rnd.random() < 1 / 3 and (n_hit + ext) // 16 * 16 > n_hit:
                        ext = (n_hit + ext) // 16 * 16 - n_hit
                delay = ext > 0 and rnd.random() < P_ASYNC
                if delay and v033 and rnd.random() < P_WHOLE_PROMPT:
                    ext = len(tokens[rid]) - n_hit  # 0.33 recomputes the last token once it lands
                if replay and ext and not delay and rnd.random() < P_WHOLE_SYNC:
                    ext = len(tokens[rid]) - n_hit  # a synchronous load of the whole sequence
                replayed = 0
                if replay:
                    before = n_hit + ext
                    n_hit, hit, ext, delay, replayed = _replay_admission(
                        side.sched_block, replay, n_hit, hit, ext, delay
                    )
                    counts["replay dropped"] += n_hit + ext == 0 < before
                start = n_hit + ext - replayed
                n = 0 if delay else chunk(rid, start, min(len(tokens[rid]) - start, budget, 512))
                if n == 0 and not delay:
                    break
                whole = not delay and ext > 0 and n_hit + ext == len(tokens[rid])
                counts["inside replay"] += replayed > 0 and n <= replayed
                # the replayed tokens hold slots already: vLLM's num_tokens_past_hit
                n_alloc = n - min(n, replayed)
                try:
                    # 0.33 keeps blocks free for other loads and prefills in flight
                    reserved = rnd.randint(0, 8) if delay and v033 else 0
                    skip = _loaded_groups(rnd, side.num_groups()) if delay and v033 else ()
                    new = side.first(
                        rid, n_alloc, n_hit, hit, 0 if delay else spec_tokens, ext, delay, reserved, skip
                    )
                except Anomaly as exc:
                    rec(("anomaly", exc.kind, rid, exc.blocks, ext, delay))
                    return steps - step
                rec(("admit", rid, new, side.num_free(), ext, delay))
                counts["skip zeroing"] += bool(skip) and side.zeroing
                if new is None:
                    counts["refused"] += 1
                    break
                counts["external"] += ext > 0
                counts["whole sync"] += whole
                counts["replayed"] += replayed > 0
                if ext and not delay and side.num_groups() == 1:
                    sync_loads[rid] = (n_hit, ext)
                if v033:
                    side.record_stats(rid, n_hit)
                if delay:
                    counts["async"] += 1
                    loading[rid] = rnd.randint(1, 2)
                    load_end[rid] = start
                    hits[rid] = n_hit
                    if v033:  # 0.33 sets the request's computed tokens now, 0.16 when it lands
                        computed[rid] = start
                        sync(side.advance(rid, start, []))
                    index += 1
                    continue
            waiting.pop(index)
            running.append(rid)
            computed[rid] = start
            first_cached.setdefault(rid, start)
            scheduled.append((rid, n, 0))
            budget -= n
        if v033:  # the step's output carries the new blocks' ids to zero
            zero = side.take_zeroing()
            rec(("zero", zero))
            counts["zeroed"] += len(zero)
        for rid in running + [r for r in waiting if r in loading or r in loaded]:
            rec(("blocks", rid, side.block_ids(rid)))
        rec(("free queue", side.free_head(8)))
        # the step's output: synchronous loads that failed at one of their external blocks
        # (those a window skipped hold the null block: nothing was loaded there)
        invalid: set[int] = set()
        for rid, (h, e) in sync_loads.items():
            loaded_ids = [b for b in side.block_ids(rid)[0][h // 16 : -(-(h + e) // 16)] if b]
            if loaded_ids and rnd.random() < P_FAILED_LOAD:
                invalid.add(rnd.choice(loaded_ids))
        sync_loads.clear()
        voided: dict[str, int] = {}
        if invalid:
            reach = first_cached if not v033 else {rid: computed[rid] for rid in running}
            voided, evict = _invalid_blocks(side, running, reach, invalid)
            counts["sync failed"] += len(voided)
            rec(("invalid", sorted(invalid), sorted(voided.items()), fail_policy))
            if fail_policy and evict:
                side.evict(evict)
            for rid, back in voided.items():
                if not fail_policy:  # recomputed from there; the step's output is dropped
                    computed[rid] = back
                    sync(side.advance(rid, back, []))
        for rid, n, drafts in scheduled:
            if rid not in running or rid in voided:
                continue
            done = computed[rid] + n - drafts
            if done < len(tokens[rid]):
                after_output(rid, done, [])
                continue
            first = rid not in estimated
            estimated.add(rid)
            if decode_left[rid] <= 0:
                if first and v033:
                    rec(("estimate", rid, side.estimate(rid)))
                finished.append((tokens[rid], keys[rid]))
                finish(rid)
                continue
            accepted = rnd.randint(0, drafts)
            decode_left[rid] -= 1 + accepted
            after_output(rid, done + accepted, [rnd.randrange(32000) for _ in range(1 + accepted)])
            if first and v033:
                rec(("estimate", rid, side.estimate(rid)))
        if fail_policy:
            for rid in set() | set(voided):  # vLLM fails them after the step's outputs
                finish(rid)
        rec(("events", side.events()))
        rec(("stats", side.stats()))
        side.check()
    return 0


def modes(release: str) -> list[tuple[bool, bool, str]]:
    """(caching, EAGLE, drop) settings: 0.16 EAGLE off and on; 0.33 with caching on EAGLE
    off and its trailing-block drop in the draft's group or in every group (beside a KV
    connector 0.33 drops the block instead of hashing look-ahead tokens), with caching
    off EAGLE off and on."""
    if release == "0.16":
        return [(True, False, ""), (True, True, "")]
    return [
        (True, False, ""),
        (True, True, "first"),
        (True, True, "all"),
        (False, False, ""),
        (False, True, ""),
    ]


def sides(release: str, layout: list[tuple[str, dict[str, Any]]], num_blocks: int, caching: bool, eagle: bool,
          drop: str, zeroing: bool = False) -> tuple[Callable[[], Any], Callable[[], Any]]:  # fmt: skip
    """Factories of vLLM's side and kvcoord's (``zeroing``: 0.33's needs_kv_cache_zeroing)."""
    if release == "0.16":
        return (lambda: VLLM16(layout, num_blocks, eagle)), (lambda: Ours16(layout, num_blocks, eagle))
    return (
        lambda: VLLM33(layout, num_blocks, eagle, caching, drop, zeroing),
        lambda: Ours33(layout, num_blocks, eagle, caching, drop, zeroing),
    )


def check(release: str, seeds: range, steps: int, layouts: dict[str, list[tuple[str, dict[str, Any]]]],
          out: Callable[[str], None] = print, blocks: int = 0) -> dict[str, dict[str, int]]:  # fmt: skip
    """Every layout and setting of :func:`modes`, each seed: raises
    :class:`vs_vllm.Difference` at the first differing answer; returns per layout the
    answers compared and what the runs exercised (external loads, asynchronous ones,
    anomalies by kind, restarts)."""
    totals: dict[str, dict[str, int]] = {}
    for name, layout in layouts.items():
        total = totals.setdefault(name, {})
        mamba = any(kind.startswith("mamba") for kind, _ in layout)
        for mode, (caching, eagle, drop) in enumerate(modes(release)):
            if release == "0.16" and eagle and name == "full16+swa32(w128)":
                continue  # EAGLE needs sliding block size == LCM: refused by both
            label = f"caching={caching} eagle={eagle}" + (f" drop={drop}" if drop else "")
            theirs, ours = sides(release, layout, 2, caching, eagle, drop)
            try:
                ours()
            except ConfigError as exc:
                out(f"skipped    {name} {label}: refused ({exc})")
                continue
            for seed in seeds:
                num_blocks = blocks or (400 if release == "0.16" else 300) + 200 * (seed % 4)
                # 0.33: every other run zeroes new blocks (needs_kv_cache_zeroing; mamba always)
                zeroing = release == "0.33" and (seed + mode) % 2 == 1
                # 0.33: a run in three (none with mamba) with a prefix replay window
                replay = REPLAY_033 if release == "0.33" and (seed + mode) % 3 == 1 and not mamba else 0
                theirs, ours = sides(release, layout, num_blocks, caching, eagle, drop, zeroing)
                spec = base.SPEC_TOKENS_033 if eagle and release == "0.33" else 0
                a: list[Any] = []
                b: list[Any] = []
                where = (f"{name} {label}{' zeroing' if zeroing else ''}{f' replay={replay}' if replay else ''} "
                         f"seed={seed} blocks={num_blocks}")  # fmt: skip
                counts = workload(theirs, seed, steps, a, spec, replay)
                try:
                    workload(ours, seed, steps, b, spec, replay)
                except base.Difference as exc:
                    raise base.Difference(f"{where}: {exc}") from None
                base.compare(where, a, b)
                anomalies = [x for x in a if x[0] == "anomaly"]
                counts["answers"] = len(a)
                counts["shared"] = sum(x[1] == "shared" for x in anomalies)
                counts["uncounted"] = sum(x[1] == "uncounted" for x in anomalies)
                for key, value in counts.items():
                    total[key] = total.get(key, 0) + value
                out(f"identical  {where}: {len(a)} answers, {counts['external']} external loads "
                    f"({counts['async']} async, {counts['cached']} landed, {counts['failed']} failed, {counts['dropped']} dropped), "
                    f"{counts['sync failed']} voided by a failed sync load, {counts['refused']} refusals, "
                    f"anomalies: {counts['shared']} shared, {counts['uncounted']} uncounted; zeroing: "
                    f"{counts['zeroed']} ids, {counts['skip zeroing']} skipped loads, "
                    f"{counts['zeroing recorded']} recorded after failed loads; replay: {counts['replayed']} replayed, "
                    f"{counts['whole sync']} whole-sequence sync loads, {counts['inside replay']} chunks inside the "
                    f"replayed tokens, {counts['replay dropped']} hits dropped")  # fmt: skip
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--layouts", nargs="*", help="only these layouts (names as printed)")
    parser.add_argument("--blocks", type=int, default=0, help="pool size of every run (default: by seed)")
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("run with PYTHONHASHSEED=0 so that vLLM's NONE_HASH is the seeded one")
    installed = importlib.metadata.version("vllm")
    release = ".".join(installed.split(".")[:2])
    if release not in ("0.16", "0.33"):
        raise SystemExit(f"vLLM {installed} is installed; this compares with 0.16.x or 0.33.x")
    every = layouts(release)
    chosen = {k: v for k, v in every.items() if not args.layouts or k in args.layouts}
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    try:
        totals = check(release, seeds, args.steps, chosen, lambda line: print(line, flush=True), args.blocks)
    except base.Difference as exc:
        raise SystemExit(str(exc)) from None
    for name, t in totals.items():
        print(f"{name:<31} {t.get('answers', 0):>8} answers {t.get('external', 0):>5} external "
              f"{t.get('async', 0):>5} async {t.get('failed', 0):>4} failed {t.get('dropped', 0):>4} dropped "
              f"{t.get('sync failed', 0):>4} sync-failed {t.get('whole', 0):>3} whole {t.get('shared', 0):>3} shared {t.get('uncounted', 0):>3} uncounted "
              f"{t.get('zeroed', 0):>6} zeroed {t.get('skip zeroing', 0):>4} skip-zeroing {t.get('zeroing recorded', 0):>3} zeroing-recorded "
              f"{t.get('replayed', 0):>4} replayed {t.get('whole sync', 0):>3} whole-sync")  # fmt: skip
    answers = sum(t.get("answers", 0) for t in totals.values())
    print(f"connector check: {answers} answers identical to vLLM {installed}")


if __name__ == "__main__":
    main()
