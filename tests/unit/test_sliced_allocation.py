"""KVCachePool.allocating_slots: an allocation taken and cached a slice at a time gives
the answer, tables, free counts and events of one allocate_slots call."""

from __future__ import annotations

import random

import pytest
from kvcoord.engine import FullAttentionSpec, SlidingWindowSpec
from kvcoord.engine.pool import KVCachePool
from kvcoord.engine.results import BlockIds
from support import Driver
from support import drive as run_to_end


def drive(pool: KVCachePool, every: int, rid: str, *args: object) -> tuple[BlockIds | None, int]:
    """``allocating_slots`` run to its end: its answer and how often it yielded."""
    return run_to_end(pool.allocating_slots(every, rid, *args))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "specs", [(FullAttentionSpec(4),), (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8))]
)
def test_sliced_allocation_equals_one_call(specs: tuple[object, ...]) -> None:
    """Large and small prompts, chunked and whole, over a pool reused until its cached
    blocks are evicted, refusals and lookahead included: the same answers, tables, free
    counts and events as one call; large allocations yield between slices."""
    rnd = random.Random(23)
    whole, sliced = (Driver(specs, num_blocks=300, enable_kv_cache_events=True) for _ in range(2))
    seen = {"sliced": 0, "refused": 0}
    live: list[str] = []
    for i in range(120):
        rid = f"r{i}"
        tokens = [rnd.randrange(6) for _ in range(rnd.randint(1, 400))]
        for d in (whole, sliced):
            d.add(rid, tokens)
        n = rnd.choice((len(tokens), max(1, len(tokens) // 2)))
        look = rnd.choice((0, 0, 3))
        every = rnd.choice((1, 7, 16))
        want = whole.pool.allocate_slots(rid, n, 0, None, look)
        got, yields = drive(sliced.pool, every, rid, n, 0, None, look)
        assert got == want
        if got is None:
            seen["refused"] += 1
            assert yields == 0
        elif sum(map(len, got)) > every:
            seen["sliced"] += 1
            assert yields >= sum(map(len, got)) // every
        assert sliced.pool.get_block_ids(rid) == whole.pool.get_block_ids(rid)
        assert sliced.pool.num_free_blocks == whole.pool.num_free_blocks
        assert sliced.pool.take_events() == whole.pool.take_events()
        assert sliced.pool.snapshot() == whole.pool.snapshot()
        live.append(rid)
        while live and (got is None or rnd.random() < 0.5):
            gone = live.pop(rnd.randrange(len(live)))
            for d in (whole, sliced):
                d.pool.free(gone)
            got = ()
    assert seen["sliced"] > 20 and seen["refused"] > 3, seen


def test_a_call_with_a_hit_is_made_at_once() -> None:
    """A call outside the common path (here a hit to adopt) is allocate_slots itself,
    with no yield."""
    whole, sliced = (
        Driver((FullAttentionSpec(4),), num_blocks=64, enable_kv_cache_events=True) for _ in range(2)
    )
    tokens = list(range(40))
    for d in (whole, sliced):
        d.add("a", tokens)
        d.pool.allocate_slots("a", 40)
        d.add("b", tokens + [7] * 40)
    hit = whole.hit("b")
    assert hit.num_tokens
    want = whole.pool.allocate_slots("b", 80 - hit.num_tokens, hit.num_tokens, hit)
    got, yields = drive(sliced.pool, 1, "b", 80 - hit.num_tokens, hit.num_tokens, sliced.hit("b"))
    assert (got, yields) == (want, 0)
    assert sliced.pool.take_events() == whole.pool.take_events()


def test_a_large_allocation_in_a_sliced_step_keeps_its_watermark() -> None:
    """A vllm-0.33 pool's Step applied in slices (as the server does): an allocation
    large enough to be taken in slices (SLICED_ALLOCATE_TOKENS) that would leave fewer
    free blocks than its watermark is refused, as the same Step applied at once
    refuses it. (The sliced path once dropped AllocateOp.watermark_blocks: the
    allocation was granted.)"""
    from kvcoord.engine import KVCacheConfig
    from kvcoord.service import operations as op
    from kvcoord.service.pool_service import SLICED_ALLOCATE_TOKENS, Fence, Limits, PoolService
    from kvcoord.service.sessions import SessionTable
    from kvcoord.service.testing import ManualClock

    bs = 16
    n = SLICED_ALLOCATE_TOKENS
    need = n // bs

    def pool() -> PoolService:
        cfg = KVCacheConfig(
            num_blocks=need + 10, groups=(FullAttentionSpec(bs),), hash_block_size=bs,
            enable_caching=False, max_model_len=2 * n, profile="vllm-0.33",
        )  # fmt: skip
        return PoolService("p", cfg, ("sha256_cbor", bs, "0"), Fence("i", 1), Limits(),
                           SessionTable(ManualClock(), 30.0, 60.0))  # fmt: skip

    answers = []
    for every in (0, 1):
        p = pool()
        s = p.attach("sha256_cbor", bs, "0", "test", 0, profile="vllm-0.33")
        free = p.num_free_blocks
        for watermark in (free - need + 1, free - need):  # refused, then granted at the edge
            rid = f"r{watermark}"
            sync = op.RequestSync(rid, append_token_ids=list(range(n)), new_request=True)
            ops = [op.Allocate(sync, n, num_new_computed_tokens=0, watermark_blocks=watermark)]
            outcomes = drain_with(p, s, ops, every)
            value = outcomes[0].value
            answers.append(
                (every, watermark - (free - need), value.new_block_ids is not None, outcomes[0].error)
            )  # type: ignore[attr-defined]
    # at once and sliced: one block over the edge refused, at the edge granted
    assert [(over, granted) for _, over, granted, _ in answers] == [(1, False), (0, True)] * 2
    assert all(err is None for *_, err in answers)


def drain_with(p: object, s: object, ops: list[object], every: int) -> list[object]:
    """``PoolService.applying`` run to its end (every: 0 applies at once)."""
    work = p.applying(s, ops, every)  # type: ignore[attr-defined]
    while True:
        try:
            next(work)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
