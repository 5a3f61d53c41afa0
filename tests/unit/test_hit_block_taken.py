"""A first allocation with external (KV connector) tokens must not hand one block to two groups.

vLLM 0.16.0 adopts a first-use request's hit and external tokens group by group (touch
the group's hit blocks, then take blocks for the external tokens from the free queue's
head). A later group's hit block that is free and at the head is taken by an earlier
group (its hash dropped) and then touched by its own group: the block ends up in two
groups' tables (vLLM 0.16.0's own manager does this: tests/with_vllm/test_hit_block_taken_vs_vllm.py).
A vllm-0.16 pool raises :class:`HitBlockTakenError` instead, before anything changes; a
vllm-0.33 pool touches every group's hit first (vLLM 0.24+) and never meets the case.

The case needs a hit whose later-group block is free while the request's hit reaches a
mamba state: request "p0" caches the first block of the prompt (and frees it), request
"p" computes the whole prefix without a hit (no mamba state at the first block) and
keeps running, so the full-attention hit is p0's free block followed by p's held one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from kvcoord.engine import (
    ErrorStatus,
    FailedPreconditionError,
    HitBlockTakenError,
    KVCacheConfig,
    KVCachePool,
    UncountedBlocksError,
)
from kvcoord.engine.invariants import check_pool
from kvcoord.engine.specs import FullAttentionSpec, MambaCacheMode, MambaSpec, SlidingWindowSpec
from unit.test_mamba_external import hashes, whole_state

PROFILES = ("vllm-0.16", "vllm-0.33")
PREFIX = list(range(1, 9))  # two blocks of 4
PROMPT = PREFIX + [9, 10, 11, 12, 13]  # the request "e" that adopts the hit and 1 external token

Spec = Callable[[], Any]
MAMBA: Spec = lambda: MambaSpec(4, MambaCacheMode.ALIGN, 0)  # noqa: E731
FULL: Spec = lambda: FullAttentionSpec(4)  # noqa: E731
SWA: Spec = lambda: SlidingWindowSpec(4, 64)  # noqa: E731


def make(groups: tuple[Spec, ...], profile: str, num_blocks: int = 20) -> KVCachePool:
    more: dict[str, Any] = (
        {} if profile == "vllm-0.16" else {"profile": profile, "max_in_flight_tokens": 1024}
    )
    return KVCachePool(KVCacheConfig(num_blocks, tuple(g() for g in groups), 4, max_model_len=64, **more))


def add(p: KVCachePool, rid: str, tokens: list[int]) -> None:
    p.add_request(rid, tokens, hashes(tokens))


def step(p: KVCachePool) -> None:
    if p.config.profile == "vllm-0.33":
        p.new_step_starts()  # (a state cached this step is not adopted before the next)


def setup(groups: tuple[Spec, ...], profile: str, holders: int | None, num_blocks: int = 20) -> KVCachePool:
    """p0 (first block shared with the prompt, freed), q (16 unrelated tokens, freed:
    blocks behind p0's in the free queue), p (the prefix, computed without a hit, still
    running), then ``holders`` requests of 3 tokens; ``None``: as many as it takes to
    bring a free block of the hit to the queue's head."""
    p = make(groups, profile, num_blocks)
    p0 = PREFIX[:4] + [50, 51, 52, 53]
    q = list(range(200, 217))
    add(p, "p0", p0)
    add(p, "q", q)
    assert p.allocate_slots("p0", 8) is not None and p.allocate_slots("q", 16) is not None
    p.free("p0")
    p.free("q")
    step(p)
    add(p, "p", PREFIX + [99])
    assert p.allocate_slots("p", 8) is not None
    step(p)
    add(p, "e", PROMPT)
    hit = {b for g in p.get_computed_blocks("e").block_ids for b in g if b}
    k = 0
    while holders is None or k < holders:
        head = p.free_queue_head(1)
        if holders is None and (not head or head[0] in hit):
            break
        add(p, f"h{k}", [1000 + k, 2000 + k, 3000 + k])
        if p.allocate_slots(f"h{k}", 3) is None:
            p.free(f"h{k}")
            break
        k += 1
    return p


def shared_blocks(p: KVCachePool) -> list[int]:
    """Block ids held in more than one group (over every request's tables)."""
    groups: dict[int, set[int]] = {}
    for rid in p.requests:
        for gid, table in enumerate(p.get_block_ids(rid)):
            for bid in table:
                if bid:
                    groups.setdefault(bid, set()).add(gid)
    return sorted(b for b, g in groups.items() if len(g) > 1)


def adopt(p: KVCachePool, hit: Any) -> Any:
    """Request "e"'s first allocation: ``hit`` (its lookup's), 1 external token, the rest new."""
    return p.allocate_slots("e", len(PROMPT) - hit.num_tokens - 1, hit.num_tokens, hit, 0, 1)


def test_mamba_first_a_later_groups_free_hit_block_at_the_head_is_refused_with_nothing_changed() -> None:
    """(mamba align, full): the full group's hit is [2, 11], block 2 free at the queue's
    head; vLLM 0.16.0's mamba group would take block 2 for the external token's state and
    the full group would then touch it (tables [0, 0, 2, 8] and [2, 11, 4, 7])."""
    p = setup((MAMBA, FULL), "vllm-0.16", None)
    hit = p.get_computed_blocks("e")
    assert (hit.num_tokens, hit.block_ids) == (8, ((0, 9), (2, 11)))
    assert p.free_queue_head(2) == [2, 4]
    before, free = whole_state(p), p.num_free_blocks
    with pytest.raises(HitBlockTakenError) as err:
        adopt(p, hit)
    assert isinstance(err.value, FailedPreconditionError)
    assert err.value.status is ErrorStatus.FAILED_PRECONDITION
    assert err.value.reason == "HIT_BLOCK_TAKEN"
    assert "block 2 (group 1's hit) by group 0" in str(err.value)
    assert whole_state(p) == before
    assert check_pool(p).violations == ()
    assert p.num_free_blocks == free and shared_blocks(p) == []
    # the request is usable: without the hit its external tokens take fresh blocks
    assert p.allocate_slots("e", len(PROMPT) - 1, 0, None, 0, 1) is not None
    assert check_pool(p).violations == () and shared_blocks(p) == []


def test_vllm_033_touches_every_hit_first_and_allocates() -> None:
    """The same pool under vllm-0.33 (vLLM 0.24+'s two-phase adoption): the full group's
    hit block 2 is touched before the mamba group takes its block, so the mamba group
    gets block 4 and no block is held twice (a regression guard on that order)."""
    p = setup((MAMBA, FULL), "vllm-0.33", None)
    hit = p.get_computed_blocks("e")
    assert (hit.num_tokens, hit.block_ids) == (8, ((0, 1), (2, 10)))
    assert p.free_queue_head(2) == [2, 4]
    assert adopt(p, hit) == ((7,), (6,))
    assert p.get_block_ids("e") == ((0, 0, 4, 7), (2, 10, 8, 6))
    assert check_pool(p).violations == () and shared_blocks(p) == []


def test_sliding_window_first_takes_the_full_groups_hit_too() -> None:
    """Not only mamba: (sliding window, full) with the hit's request freed. Its blocks
    come back tail first, group by group ([S1, S0, F1, F0] = [2, 1, 4, 3]); the sliding
    window group touches its hit [1, 2], then takes the head, block 4: the full group's
    second hit block."""
    p = make((SWA, FULL), "vllm-0.16", 13)
    add(p, "p", PREFIX + [99])
    assert p.allocate_slots("p", 8) == ((1, 2), (3, 4))
    p.free("p")
    for k in range(4):  # the never-used blocks 5..12
        add(p, f"h{k}", [1000 + k, 2000 + k, 3000 + k])
        assert p.allocate_slots(f"h{k}", 3) is not None
    p.free("h0")
    p.free("h1")  # (the allocation takes 8 blocks: 4 hit blocks to touch, 4 new)
    add(p, "e", PROMPT)
    hit = p.get_computed_blocks("e")
    assert (hit.num_tokens, hit.block_ids) == (8, ((1, 2), (3, 4)))
    assert p.free_queue_head() == [2, 1, 4, 3, 5, 6, 7, 8]
    before = whole_state(p)
    with pytest.raises(HitBlockTakenError, match=r"block 4 \(group 1's hit\) by group 0"):
        adopt(p, hit)
    assert whole_state(p) == before and check_pool(p).violations == ()


LAYOUTS = {
    "mamba,full": (MAMBA, FULL),
    "full,mamba": (FULL, MAMBA),
    "mamba,full,swa": (MAMBA, FULL, SWA),
    "swa,mamba,full": (SWA, MAMBA, FULL),
    "swa,full": (SWA, FULL),
}


@pytest.mark.parametrize(("profile", "layout"), list(itertools.product(PROFILES, LAYOUTS)))
def test_over_the_free_queue_no_block_is_ever_held_twice(profile: str, layout: str) -> None:
    """Every number of holders (the free queue's head moving through the hit's blocks):
    an allocation that goes through leaves no block in two groups and the pool clean; a
    refusal (vllm-0.16 only) changes nothing and is exactly where the group-by-group
    adoption would have shared a block."""
    outcomes = []
    for holders in range(0, 9):
        p = setup(LAYOUTS[layout], profile, holders, num_blocks=24)
        hit = p.get_computed_blocks("e")
        if hit.num_tokens == 0:
            outcomes.append("no hit")
            continue
        before = whole_state(p)
        try:
            got = adopt(p, hit)
        except HitBlockTakenError:
            assert profile == "vllm-0.16"
            assert whole_state(p) == before and check_pool(p).violations == ()
            outcomes.append("refused")
            continue
        except UncountedBlocksError:
            assert whole_state(p) == before
            outcomes.append("uncounted")
            continue
        if got is None:
            outcomes.append("none")
            continue
        assert check_pool(p).violations == ()
        assert shared_blocks(p) == []
        outcomes.append("ok")
    assert "ok" in outcomes, outcomes
    if profile == "vllm-0.16" and layout in ("mamba,full", "mamba,full,swa"):
        assert "refused" in outcomes, outcomes
