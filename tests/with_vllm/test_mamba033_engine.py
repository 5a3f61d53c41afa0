"""kvcoord's vllm-0.33 mamba groups against vLLM 0.33.0's own KVCacheManager, call by call.

Runs in the vLLM 0.33.0 venv only (``KVCOORD_VLLM_VERSION=0.33.0 scripts/test_vllm.sh
-k mamba033``). A seeded synchronous scheduler (shared prefixes, resends, chunks cut at
mamba block boundaries as vLLM's scheduler cuts them, decode, frees, preemptions, a
connector's evict_blocks) drives both managers with the same calls; every answer is
compared: new block ids, hits and junctions, free counts, the free queue's order, the
tables, the three per-step drains (new block ids, boundary-state offloads, copy pairs)
and the statistics. Beyond the one recorded trace (hybrid_full32_mamba32_align), it
covers the layouts and calls that trace lacks: dense retention, "none" mode and align
mode with caching off, evictions of held state blocks, preemption.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from harness import V033

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (this venv has another release)")

BS = 32
MAX_LEN = 1024
BUDGET = 192

#: name -> (mamba_cache_mode, enable_caching, prefix_cache_retention_interval, prefill
#: checkpoint alignment: ``None`` for no prefill checkpoint block, else the group has one;
#: hash block)
CASES = {
    "align-sparse": ("align", True, 0, None, BS),
    "align-dense": ("align", True, None, None, BS),
    "align-nocache": ("align", False, 0, None, BS),
    "none-nocache": ("none", False, 0, None, BS),
    # Mamba2 models' layout (mamba_mixer2.py: one checkpoint block, alignment 1)
    "align-sparse-ckpt1": ("align", True, 0, 1, BS),
    # GDN models' layout (a coarser grid: here the block size)
    "align-sparse-ckpt32": ("align", True, 0, BS, BS),
    "align-dense-ckpt1": ("align", True, None, 1, BS),
    # a grid coarser than the block: only some chunks can take the checkpoint
    "align-sparse-ckpt64": ("align", True, 0, 2 * BS, BS),
    # fine-grained (partial) hits with copy-on-write: a hash block of half the block
    "align-partial": ("align", True, 0, None, BS // 2),
    # both: Mamba2's and GDN's prefill checkpoint block beside fine-grained hits
    "align-partial-ckpt1": ("align", True, 0, 1, BS // 2),
    "align-partial-ckpt32": ("align", True, 0, BS, BS // 2),
    "align-partial-dense-ckpt1": ("align", True, None, 1, BS // 2),
    # with speculative mamba blocks (n-gram drafts or a draft model: one per draft token)
    "align-partial-spec2": ("align", True, 0, None, BS // 2),
    "align-partial-ckpt1-spec3": ("align", True, 0, 1, BS // 2),
}
#: name -> the mamba group's num_speculative_blocks (0 when not listed)
SPEC_BLOCKS = {"align-partial-spec2": 2, "align-partial-ckpt1-spec3": 3}


def _vllm(
    mode: str,
    caching: bool,
    interval: int | None,
    num_blocks: int,
    ckpt: int | None = None,
    hbs: int = BS,
    junction: bool = False,
    spec: int = 0,
) -> Any:
    import torch
    from vllm.v1 import kv_cache_interface as k
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    full = k.FullAttentionSpec(BS, num_kv_heads=2, head_size=16, dtype=torch.float16)
    mamba = k.MambaSpec(
        block_size=BS if mode == "align" else MAX_LEN,
        shapes=((2, 16), (4, 8)),
        dtypes=(torch.float16, torch.float16),
        mamba_cache_mode=mode,
        num_prefill_checkpoint_blocks=int(ckpt is not None),
        prefill_checkpoint_alignment=ckpt,
        num_speculative_blocks=spec,
    )
    config = k.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        # (an EAGLE group: vLLM 0.33 turns enable_mamba_shared_prefix_checkpoint on only then)
        kv_cache_groups=[
            k.KVCacheGroupSpec(["attn"], full),
            k.KVCacheGroupSpec(["mixer"], mamba, is_eagle_group=junction),
        ],
    )
    config.prefix_cache_retention_interval = interval
    sched = BS if mode == "align" else MAX_LEN
    return KVCacheManager(
        config, max_model_len=MAX_LEN, scheduler_block_size=sched, hash_block_size=hbs,
        max_in_flight_tokens=BUDGET, enable_caching=caching, log_stats=True, enable_kv_cache_events=True,
        enable_mamba_shared_prefix_checkpoint=junction,
    )  # fmt: skip


def _ours(
    mode: str,
    caching: bool,
    interval: int | None,
    num_blocks: int,
    ckpt: int | None = None,
    hbs: int = BS,
    junction: bool = False,
    spec: int = 0,
) -> Any:
    from kvcoord.engine import KVCacheConfig, KVCachePool
    from kvcoord.engine.specs import FullAttentionSpec, MambaCacheMode, MambaSpec

    mamba = MambaSpec(
        BS if mode == "align" else MAX_LEN, MambaCacheMode(mode),
        num_prefill_checkpoint_blocks=int(ckpt is not None), prefill_checkpoint_alignment=ckpt,
        num_speculative_blocks=spec,
    )  # fmt: skip
    return KVCachePool(
        KVCacheConfig(
            num_blocks, (FullAttentionSpec(BS), mamba), hbs, enable_caching=caching, max_model_len=MAX_LEN,
            profile="vllm-0.33", max_in_flight_tokens=BUDGET, prefix_cache_retention_interval=interval,
            enable_kv_cache_events=True, mamba_shared_prefix_checkpoint=junction,
        )
    )  # fmt: skip


class _Both:
    """One vLLM manager and one kvcoord pool, called alike; every answer compared."""

    def __init__(
        self,
        mode: str,
        caching: bool,
        interval: int | None,
        num_blocks: int,
        ckpt: int | None = None,
        hbs: int = BS,
        junction: bool = False,
        spec: int = 0,
    ) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name("sha256_cbor")
        init_none_hash(fn)
        self.hasher = get_request_block_hasher(hbs, fn) if caching else None
        self.theirs = _vllm(mode, caching, interval, num_blocks, ckpt, hbs, junction, spec)
        self.ours = _ours(mode, caching, interval, num_blocks, ckpt, hbs, junction, spec)
        assert self.theirs.mamba_shared_prefix_checkpoint == junction
        self.hbs = hbs
        self.ckpt = ckpt
        self.junction = junction
        #: chunks that stopped exactly at their request's shared-prefix junction
        self.junction_stops = 0
        self.reqs: dict[str, Any] = {}
        self.calls = 0
        self.num_events = 0
        self.num_copies = 0
        self.popped: list[tuple[str, Any]] = []

    def same(self, what: str, theirs: Any, ours: Any) -> None:
        self.calls += 1
        assert ours == theirs, f"{what}: vLLM {theirs!r}, kvcoord {ours!r}"

    def add(self, rid: str, prompt: list[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        r = Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=self.hasher)
        self.reqs[rid] = r
        self.ours.add_request(rid, prompt, [bytes(h) for h in r.block_hashes])

    def step(self) -> None:
        self.theirs.new_step_starts()
        self.ours.new_step_starts()

    def admit(self, rid: str, budget: int) -> int | None:
        """Lookup and admission (full sequence must fit); the tokens scheduled, or None."""
        from vllm.v1.request import RequestStatus

        r = self.reqs[rid]
        r.status = RequestStatus.WAITING
        blocks, hit, junction = self.theirs.get_computed_blocks(r)
        r.shared_prefix_boundary = junction
        ours = self.ours.get_computed_blocks(rid)
        self.same("hit", (blocks.get_block_ids(), hit, junction),
                  (tuple(list(g) for g in ours.block_ids), ours.num_tokens, self.ours.shared_prefix_boundary(rid)))  # fmt: skip
        n = self.chunk(r, hit, budget, r.num_tokens - hit)
        if n == 0:
            return None
        new = self.theirs.allocate_slots(
            r, n, hit, blocks, full_sequence_must_fit=True, has_scheduled_reqs=True
        )
        got = self.ours.allocate_slots(rid, n, hit, ours if hit else None, full_sequence_must_fit=True)
        self._same_alloc(new, got)
        if new is None:
            return None
        r.status = RequestStatus.RUNNING
        self.theirs.record_prefix_cache_stats(r, hit)
        self.ours.record_prefix_cache_stats(rid, hit)
        r.num_computed_tokens = hit  # advanced by n after the step
        return n

    def chunk(self, r: Any, start: int, budget: int, left_of_prompt: int) -> int:
        """The tokens vLLM 0.33's scheduler gives a request from ``start`` on."""
        if self.hbs == BS:
            return _chunk(r.num_tokens - start, budget, left_of_prompt)
        n = _chunk_partial(r.num_prompt_tokens, r.num_tokens, start, budget, self.hbs, self.ckpt,
                           r.shared_prefix_boundary, self.junction)  # fmt: skip
        if n and start + n == r.shared_prefix_boundary:
            self.junction_stops += 1
        return n

    def release(self, retained: Any) -> None:
        """The scheduler's release of the copies' blocks once they ran."""
        self.theirs.block_pool.free_blocks(retained)
        self.ours.release_retained_blocks([b.block_id for b in retained])

    def allocate(self, rid: str, n: int) -> bool:
        r = self.reqs[rid]
        new = self.theirs.allocate_slots(r, n)
        got = self.ours.allocate_slots(rid, n)
        self._same_alloc(new, got)
        return new is not None

    def _same_alloc(self, new: Any, got: Any) -> None:
        theirs = None if new is None else [list(g) for g in new.get_block_ids()]
        if theirs is not None and not any(theirs):
            theirs = [[] for _ in theirs]
        self.same("new blocks", theirs, None if got is None else [list(g) for g in got])
        self.same("free", self.theirs.block_pool.get_num_free_blocks(), self.ours.num_free_blocks)

    def advance(self, rid: str, computed: int, token: int | None) -> None:
        r = self.reqs[rid]
        r.num_computed_tokens = computed
        before = len(r.block_hashes)
        if token is not None:
            r.append_output_token_ids(token)
        self.ours.update_request(
            rid, num_computed_tokens=computed, append_token_ids=[] if token is None else [token],
            append_block_hashes=[bytes(h) for h in r.block_hashes[before:]],
        )  # fmt: skip

    def free(self, rid: str) -> None:
        self.theirs.free(self.reqs.pop(rid))
        self.ours.free(rid)

    def pop(self, rid: str) -> None:
        """vLLM 0.33's deferred free, first half (a KV consumer with overlapping steps):
        the blocks taken, returned by :meth:`release_popped`."""
        self.popped.append((rid, self.theirs.pop_blocks_for_free(self.reqs.pop(rid))))
        self.ours.drop_boundary_state_offloads(rid)

    def release_popped(self) -> None:
        """The deferred frees' second half, oldest first (the scheduler's drain)."""
        for rid, blocks in self.popped:
            self.theirs.block_pool.free_blocks(reversed(blocks))
            self.ours.free(rid, all_groups_reversed=True)
        self.popped = []

    def preempt(self, rid: str) -> None:
        r = self.reqs[rid]
        self.theirs.free(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.ours.preempt(rid)

    def evict_one(self, rng: random.Random) -> None:
        """A connector's failed load: drop the hash of a random held block."""
        held = sorted({b for r in self.reqs for g in self.ours.get_block_ids(r) for b in g if b})
        if held:
            ids = {rng.choice(held)}
            self.theirs.evict_blocks(ids)
            self.ours.evict_blocks(ids)

    def same_events(self) -> None:
        from kvcoord.conformance.target import event_to_json

        fields = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "group_idx",
                  "kv_cache_spec_kind")  # fmt: skip
        ours = [{k: e.get(k) for k in fields} for e in map(event_to_json, self.ours.take_events())]
        self.same("events", [_event(e, fields) for e in self.theirs.take_events()], ours)
        self.num_events += len(ours)

    def end_of_step(self) -> None:
        self.same_events()
        self.same("offloads", self.theirs.take_boundary_state_offloads(),
                  {r: [tuple(e) for e in v] for r, v in self.ours.take_boundary_state_offloads().items()})  # fmt: skip
        copies, retained = self.theirs.take_kv_cache_block_copies()
        self.same("copies", ([(c.src_block_id, c.dst_block_id) for c in copies], [b.block_id for b in retained]),
                  self.ours.take_kv_cache_block_copies())  # fmt: skip
        self.num_copies += len(copies)
        if retained:
            self.release(retained)
        self.same("new block ids", self.theirs.take_new_block_ids(), self.ours.take_new_block_ids())
        queue = [b.block_id for b in self.theirs.block_pool.free_block_queue.get_all_free_blocks()]
        self.same("free queue", queue, self.ours.free_queue_head(None))
        for rid in self.reqs:
            self.same(f"table {rid}", [list(g) for g in self.theirs.get_block_ids(rid)],
                      [list(g) for g in self.ours.get_block_ids(rid)])  # fmt: skip
        s, o = self.theirs.make_prefix_cache_stats(), self.ours.make_prefix_cache_stats()
        fields = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")
        self.same("stats", [getattr(s, f) for f in fields], [getattr(o, f) for f in fields])


def _int64(h: Any) -> int | None:
    """vLLM's event hash (bytes, or already its integer form) as an integer."""
    if h is None or isinstance(h, int):
        return h
    return int.from_bytes(bytes(h)[-8:], "big")


def _event(e: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """A vLLM 0.33 KV event in the trace's JSON shape (the compared fields)."""
    out: dict[str, Any] = {"type": type(e).__name__}
    for f in fields[1:]:
        out[f] = getattr(e, f, None)
    if "block_hashes" in out and out["block_hashes"] is not None:
        out["block_hashes"] = [_int64(h) for h in out["block_hashes"]]
    out["parent_block_hash"] = _int64(out.get("parent_block_hash"))
    if out.get("token_ids") is not None:
        out["token_ids"] = list(out["token_ids"])
    return out


def _chunk_partial(
    prompt: int, tokens: int, start: int, budget: int, hbs: int, ckpt: int | None = None,
    junction: int = 0, checkpoint: bool = False,
) -> int:  # fmt: skip
    """vLLM 0.33's scheduler with mamba align and partial hits (no EAGLE drop): a prefill
    chunk ends on a block boundary unless it is the prompt's last, stops at the next
    boundary when it starts inside a block, at the last cacheable block boundary, at the
    prompt's last hash boundary, and before the shared-prefix ``junction``
    (block-floored from the start; at the junction itself within the prompt with
    ``checkpoint``, enable_mamba_shared_prefix_checkpoint); but the chunk reaching the
    prefill's end that can export the prefill checkpoint (``ckpt``: the checkpoint
    alignment of a group with a prefill checkpoint block) runs on to it. (The junction
    stop and the prefill checkpoint together are not modelled: the pool refuses
    shared-prefix checkpoints beside prefill checkpoint blocks.)"""
    end = start + min(tokens - start, budget)
    prefill_end = max(prompt, tokens - 1)
    if start >= prefill_end:
        return end - start
    position = (prefill_end - 1) // hbs * hbs
    internal = (
        ckpt is not None
        and end >= prefill_end
        and start % hbs == 0
        and -(-end // BS) - 2 > (start - 1) // BS
        and start + hbs <= position
        and start < position < end
        and (position - start) % ckpt == 0
    )
    if end < prefill_end:
        end = end // BS * BS
    last_cache = 0 if internal else (tokens - 1) // BS * BS
    tail = 0 if internal else (prompt - 1) // hbs * hbs
    stops = (
        (start // BS + 1) * BS if start % BS and not internal else 0,
        last_cache,
        tail if last_cache < tail < prompt else 0,
        (junction if checkpoint and junction <= prompt else start + (junction - start) // BS * BS)
        if start < junction < end
        else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def _chunk(remaining: int, budget: int, left_of_prompt: int) -> int:
    """vLLM's scheduler with mamba align: a chunk that is not the prompt's last ends on
    a block boundary."""
    n = min(remaining, budget)
    if n < left_of_prompt:
        n = n // BS * BS
    return n


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mamba_groups_answer_like_vllm_033(case: str, seed: int) -> None:
    _run_seeded(case, seed, deferred=False)


#: the layouts a KV consumer runs with overlapping steps (fine-grained hits refuse a
#: KV connector)
DEFERRED_CASES = sorted(c for c in CASES if not c.startswith("align-partial"))


@pytest.mark.parametrize("case", DEFERRED_CASES)
@pytest.mark.parametrize("seed", [1, 2])
def test_deferred_frees_beside_a_mamba_group_answer_like_vllm_033(case: str, seed: int) -> None:
    """vLLM 0.33's deferred frees (a KV consumer with overlapping steps): a finished or
    preempted request's blocks are taken (``pop_blocks_for_free``: the mamba group drops
    the request's state and pending hand-offs at once) and returned after the next step
    (``block_pool.free_blocks(reversed(...))``: all groups in one pass). kvcoord's
    ``drop_boundary_state_offloads`` then ``free(all_groups_reversed=True)``: the same
    tables, new blocks, free queue and drains as vLLM 0.33.0's own manager, driven
    alike in this test. (The pool refused a deferred free beside mamba before.)"""
    _run_seeded(case, seed, deferred=True)


def _run_seeded(
    case: str,
    seed: int,
    deferred: bool,
    junction: bool = False,
    lengths: tuple[int, ...] = (32, 64, 100, 160),
    short_tails: float = 0.0,
) -> Any:
    mode, caching, interval, ckpt, hbs = CASES[case]
    rng = random.Random(seed)
    both = _Both(mode, caching, interval, num_blocks=70, ckpt=ckpt, hbs=hbs, junction=junction,
                 spec=SPEC_BLOCKS.get(case, 0))  # fmt: skip
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice(lengths))] for _ in range(3)]
    sent: list[list[int]] = []
    waiting: list[str] = []
    running: dict[str, int] = {}  # request -> output tokens still to produce
    next_id = 0
    for _ in range(90):
        both.step()
        for _ in range(rng.choice([0, 1, 1, 2])):
            if sent and rng.random() < 0.25:
                prompt = list(rng.choice(sent))  # a resend
            elif sent and ckpt is not None and hbs != BS and rng.random() < 0.4:
                # a sent prompt cut and extended: a hit inside a block whose chunk runs on
                # to the prefill's end, taking the checkpoint beside the copied tail
                cut = rng.choice(sent)
                prompt = cut[: len(cut) - rng.randrange(hbs)]  # hits its tail's state
                prompt += [rng.randrange(1000) for _ in range(rng.randrange(40, 120))]
            else:
                tail = 1 if rng.random() < short_tails else rng.randrange(1, 90)
                prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(tail)]
            sent.append(prompt)
            rid = f"r{next_id}"
            next_id += 1
            both.add(rid, prompt)
            waiting.append(rid)
        budget = BUDGET
        scheduled: dict[str, int] = {}
        for rid in list(running):
            r = both.reqs[rid]
            n = both.chunk(r, r.num_computed_tokens, budget, r.num_prompt_tokens - r.num_computed_tokens)
            if n <= 0:
                continue
            if not both.allocate(rid, n):
                del running[rid]
                if deferred:  # taken for a deferred free (not resumed here)
                    both.pop(rid)
                    continue
                both.preempt(rid)
                waiting.insert(0, rid)
                continue
            scheduled[rid] = n
            budget -= n
        while waiting and budget > 0:
            n = both.admit(waiting[0], budget)
            if n is None:
                break
            rid = waiting.pop(0)
            running.setdefault(rid, rng.randrange(1, 12))
            scheduled[rid] = n
            budget -= n
        both.end_of_step()
        both.release_popped()  # the step before is processed: its frees return
        for rid, n in scheduled.items():
            if rid not in both.reqs:
                continue
            r = both.reqs[rid]
            computed = r.num_computed_tokens + n
            token = rng.randrange(1000) if computed >= r.num_tokens else None
            both.advance(rid, computed, token)
            if token is not None:
                running[rid] -= 1
                if running[rid] <= 0 or rng.random() < 0.05:
                    del running[rid]
                    if deferred:
                        both.pop(rid)
                    else:
                        both.free(rid)
        if caching and rng.random() < 0.1:
            both.evict_one(rng)
    assert both.calls > 500
    assert both.num_events > 20 if caching else both.num_events == 0
    if hbs != BS:
        assert both.num_copies > 3
    return both


@pytest.mark.parametrize("seed", range(1, 9))
def test_shared_prefix_checkpoints_answer_like_vllm_033(seed: int) -> None:
    """vLLM 0.33's ``enable_mamba_shared_prefix_checkpoint`` (issue 25), as its manager
    turns it on: fine-grained hits and an EAGLE group (here the mamba group, without
    look-ahead hashes or drafts). Siblings sharing a prefix find a junction (the
    attention hit past the mamba one); the scheduler stops a prefill chunk there and the
    mamba group keys its state at it, a partial key inside a block (copied at the
    request's next allocation) or a whole block. kvcoord's pool with
    ``mamba_shared_prefix_checkpoint``: the same answers, tables, copies, hand-offs and
    events, call by call. (The pool refused the option before.)"""
    # shared prefixes ending inside blocks (and on a block end): junctions at partial keys
    both = _run_seeded(
        "align-partial", seed, deferred=False, junction=True, lengths=(48, 80, 112), short_tails=0.3
    )
    assert both.junction_stops > 0


def test_a_deferred_free_drops_pending_hand_offs_when_vllm_033_takes_the_blocks() -> None:
    """A request whose chunk just hashed a boundary state (a hand-off pending) has its
    blocks taken for a deferred free before the scheduler drains the hand-offs (vLLM
    0.33's priority preemption of a request scheduled this step): vLLM's MambaManager
    drops the hand-off at the take, and returns the blocks after the next step. kvcoord
    answers as vLLM 0.33.0's own manager, driven alike here: no hand-off for the
    request, then the same free queue, and a new request gets the same blocks."""
    both = _Both("align", True, 0, num_blocks=40)
    prompt = list(range(120))  # the prompt's boundary state: block 2 (96 tokens)
    both.step()
    both.add("a", prompt)
    assert both.admit("a", 96) == 96
    # a hand-off is pending on both sides (not drained yet)
    theirs = both.theirs.coordinator.single_type_managers[1]._pending_boundary_state_offloads
    assert [e[0] for e in theirs] == ["a"]
    assert [e[0] for e in both.ours.managers[1].pending_offloads] == ["a"]
    both.pop("a")  # before the drain
    both.end_of_step()  # the drain: nothing for "a" on either side
    both.step()
    both.release_popped()
    both.add("b", list(range(500, 600)))
    assert both.admit("b", BUDGET) == 100
    both.end_of_step()


def test_an_evicted_prompt_boundary_state_is_keyed_again_like_vllm_033() -> None:
    """A connector's evict_blocks drops the hash of a prompt's boundary state block while
    the prefill is still running (its first chunk ended exactly there); the chunk that
    completes the prompt caches up to that boundary again, and vLLM 0.33 keys the state
    block anew (its prompt-boundary rule), so a resend of the prompt hits it. kvcoord
    does the same: same tables, same hit."""
    both = _Both("align", True, 0, num_blocks=40)
    prompt = list(range(120))  # boundary (120 - 1) // 32 * 32 = 96: the state block 2
    both.step()
    both.add("a", prompt)
    assert both.admit("a", 96) == 96  # the first chunk ends at the boundary
    both.end_of_step()
    both.advance("a", 96, None)
    state = both.ours.get_block_ids("a")[1][2]
    assert state in both.ours.cached_block_ids()
    both.theirs.evict_blocks({state})
    both.ours.evict_blocks({state})
    assert state not in both.ours.cached_block_ids()
    both.step()
    assert both.allocate("a", 24)  # caches up to 96 again
    both.end_of_step()
    assert state in both.ours.cached_block_ids()
    both.advance("a", 120, 7)
    both.step()
    both.add("b", prompt)
    assert both.admit("b", BUDGET) == 24  # the hit: 96 tokens, the re-keyed state
    both.end_of_step()


@pytest.mark.parametrize("interval", [0, None])
def test_a_resumed_prefill_checkpoint_is_keyed_or_dropped_like_vllm_033(interval: int | None) -> None:
    """vLLM 0.33 with one prefill checkpoint block (Mamba2's layout): a preempted request
    replays its outputs as prefill, so its last chunk takes a checkpoint at a boundary
    past its prompt. Under sparse retention no lookup reaches that boundary, so vLLM
    leaves the block unkeyed; under dense retention it is keyed. kvcoord
    does the same: same new blocks (the checkpoint column holds a live block), tables,
    events, hashes. The ids are vLLM 0.33.0's own manager's, computed beside kvcoord's
    in this test (this venv)."""
    both = _Both("align", True, interval, num_blocks=40, ckpt=1)
    prompt = list(range(100))
    both.step()
    both.add("a", prompt)
    assert both.admit("a", BUDGET) == 100  # one chunk: its checkpoint is at 96, block 2
    both.end_of_step()
    assert both.ours.get_block_ids("a")[1][2] != 0  # the checkpoint block, not a null
    both.advance("a", 100, 1000)
    for i in range(70):  # decode up to 171 tokens
        both.step()
        assert both.allocate("a", 1)
        both.end_of_step()
        r = both.reqs["a"]
        both.advance("a", r.num_computed_tokens + 1, 1001 + i)
    both.step()
    both.preempt("a")
    evicted = set(both.ours.cached_block_ids())
    both.theirs.evict_blocks(evicted)  # no hit: the replay starts at 0
    both.ours.evict_blocks(evicted)
    assert both.admit("a", BUDGET) == 171  # the whole replay: its checkpoint is at 160, block 4
    both.end_of_step()
    ours = both.ours.get_block_ids("a")[1]
    assert ours[4] != 0  # the checkpoint column
    if interval == 0:
        assert ours[4] not in both.ours.cached_block_ids()
    else:
        assert ours[4] in both.ours.cached_block_ids()


def test_a_hit_inside_a_block_takes_the_prefill_checkpoint_beside_its_copy_like_vllm_033() -> None:
    """vLLM 0.33 with fine-grained hits (hash block 16, block 32) and one prefill
    checkpoint block (Mamba2's layout, alignment 1): a 90-token prompt
    exports its state at 80 into the checkpoint block (column 1), keyed there; a longer
    prompt sharing 85 tokens hits at 80, inside a block, and its one chunk runs on to its
    prefill's end (the scheduler does not stop at the block boundary: the backend saves
    the checkpoint at 176 within the chunk). Its allocation takes the copy-on-write
    target, the checkpoint block (column 4, not nulled) and the last state block at
    once. kvcoord answers as vLLM 0.33.0's own manager, driven alike here: same new
    blocks, tables, copy pairs, hand-offs (the checkpoint's at the tokens its key names)
    and events. (kvcoord refused the layout before.)"""
    both = _Both("align", True, 0, num_blocks=40, ckpt=1, hbs=BS // 2)
    prompt = list(range(90))
    both.step()
    both.add("a", prompt)
    assert both.admit("a", BUDGET) == 90  # one chunk: its checkpoint is at 80, column 1
    both.end_of_step()
    both.advance("a", 90, 7)
    both.free("a")
    both.step()
    both.add("b", prompt[:85] + list(range(500, 600)))
    n = both.admit("b", BUDGET)
    mamba = both.ours.managers[1]
    assert both.reqs["b"].num_computed_tokens == 80  # the hit ends inside block 2
    assert n == 105  # to the prefill's end
    assert mamba.checkpoints["b"] == (176, 4)
    assert both.ours.get_block_ids("b")[1][4] != 0  # the checkpoint column, not a null
    both.end_of_step()
    assert both.num_copies == 2  # full attention's and mamba's tails
