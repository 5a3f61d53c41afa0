"""Lookup hints, answered lookups, refusals and runs answered by a client: the engine's
margin and the service's checks, without gRPC."""

from __future__ import annotations

import random

import grpc
import pytest
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import (
    CacheHit,
    FullAttentionSpec,
    HintMismatchError,
    KVCacheConfig,
    KVCachePool,
    SlidingWindowSpec,
)
from kvcoord.service import operations as op
from kvcoord.service.errors import ErrorReason
from kvcoord.service.pool_service import Fence, Limits, PoolService
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock

NONE = none_hash("sha256_cbor", "0")


def hashes(tokens: list[int]) -> list[bytes]:
    return BlockHasher("sha256_cbor", 4, NONE).extend(tokens)


def full_pool(num_blocks: int = 16, **kw: object) -> KVCachePool:
    return KVCachePool(
        KVCacheConfig(
            num_blocks=num_blocks, groups=(FullAttentionSpec(4),), hash_block_size=4, max_model_len=256, **kw
        )  # type: ignore[arg-type]
    )


def add(pool: KVCachePool, rid: str, tokens: list[int]) -> None:
    pool.add_request(rid, tokens, hashes(tokens))


def test_free_queue_position_counts_only_live_entries() -> None:
    """first_position skips dead entries (blocks taken out of the middle) and counts
    never-used blocks ahead; the walk stops at its limit."""
    pool = full_pool(16)
    add(pool, "a", list(range(12)))  # 3 blocks, cached
    pool.allocate_slots("a", 12)
    add(pool, "b", list(range(100, 112)))
    pool.allocate_slots("b", 12)
    a_ids = pool.get_block_ids("a")[0]
    pool.free("a")  # a's blocks go to the tail (reversed), behind 9 never-used blocks
    queue = pool.free_queue_head()
    fq = pool.block_pool.free_block_queue
    for bid in a_ids:
        assert fq.first_position({bid}, 100) == queue.index(bid)
    assert fq.first_position(set(a_ids), 100) == min(queue.index(b) for b in a_ids)
    assert fq.first_position(set(a_ids), 5) == 5  # beyond the walk: the limit
    assert fq.first_position(set(), 7) == 7
    # a hit on a's first block takes it out of the middle: later blocks move up
    add(pool, "c", list(range(4)) + [999])
    hit = pool.get_computed_blocks("c")
    pool.allocate_slots("c", 1, hit.num_tokens, hit)
    queue = pool.free_queue_head()
    for bid in a_ids[1:]:
        assert fq.first_position({bid}, 100) == queue.index(bid)


@pytest.mark.parametrize("use_eagle", [False, True], ids=["plain", "eagle"])
def test_hint_margin_is_how_many_blocks_can_leave_before_the_hit_is_evicted(use_eagle: bool) -> None:
    """Allocating ``margin`` blocks keeps the hit; one more evicts a block it depends on.
    With EAGLE that includes the matched block the hit drops (freed first, as the tail
    of its table, so it is reused first): evicting it shortens the hit."""
    for extra in (0, 1):
        pool = full_pool(16, use_eagle=use_eagle)
        add(pool, "a", list(range(12)))
        pool.allocate_slots("a", 12)
        pool.free("a")
        add(pool, "w", list(range(12)) + [7])
        hit, margin = pool.lookup_hint("w", walk_limit=1000)
        assert hit.num_tokens == (8 if use_eagle else 12)
        stats_before = pool.peek_prefix_cache_stats()
        add(pool, "x", list(range(500, 500 + 4 * (margin + extra))))
        assert pool.allocate_slots("x", 4 * (margin + extra)) is not None
        now = pool.get_computed_blocks("w")
        if extra:
            assert now.num_tokens < hit.num_tokens
        else:
            assert now == hit
        # the hint itself recorded nothing
        assert stats_before is not None and stats_before.queries == 0


def test_held_hit_blocks_are_not_counted_in_the_margin() -> None:
    """A hit on blocks another request holds: the margin is the walk limit (nothing free
    of it can be reused until its holder frees it)."""
    pool = full_pool(16)
    add(pool, "a", list(range(12)))
    pool.allocate_slots("a", 12)
    add(pool, "w", list(range(12)) + [7])
    hit, margin = pool.lookup_hint("w", walk_limit=77)
    assert hit.num_tokens == 12 and margin == 77


def test_check_lookup_records_a_matching_answer_and_refuses_another() -> None:
    pool = full_pool(16, log_stats=True)
    add(pool, "a", list(range(12)))
    pool.allocate_slots("a", 12)
    add(pool, "w", list(range(12)) + [7])
    hit = pool.lookup_hint("w")[0]
    wrong = CacheHit((hit.block_ids[0][:1],), 4)
    before = pool.snapshot()
    with pytest.raises(HintMismatchError):
        pool.check_lookup("w", wrong, 4)
    assert pool.snapshot() == before  # nothing recorded
    assert pool.check_lookup("w", hit, hit.num_tokens) == hit
    stats = pool.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (1, 13, 12)


def service(exclusive: bool = True) -> tuple[PoolService, object]:
    cfg = KVCacheConfig(num_blocks=16, groups=(FullAttentionSpec(4),), hash_block_size=4, max_model_len=256)
    p = PoolService(
        "p", cfg, ("sha256_cbor", 4, "0"), Fence("i", 1), Limits(), SessionTable(ManualClock(), 30, 60)
    )
    return p, p.attach("sha256_cbor", 4, "0", "t", 0, exclusive=exclusive)


def new(rid: str, tokens: list[int]) -> op.RequestSync:
    return op.RequestSync(rid, tokens, hashes(tokens), new_request=True)


def test_hint_lookups_need_an_exclusive_session() -> None:
    p, s = service(exclusive=False)
    (o,) = p.apply(s, [op.Lookup(new("w", list(range(9))), hint=True)])  # type: ignore[arg-type]
    assert o.error is not None and o.error.code is grpc.StatusCode.FAILED_PRECONDITION
    p, s = service()
    (o,) = p.apply(s, [op.Lookup(new("w", list(range(9))), hint=True, walk_limit=5)])  # type: ignore[arg-type]
    assert isinstance(o.value, op.Hinted) and o.value.eviction_margin == 5


def test_a_wrong_answered_lookup_is_prediction_failed_and_changes_nothing() -> None:
    p, s = service()
    p.apply(s, [op.Allocate(new("a", list(range(12))), 12)])  # type: ignore[arg-type]
    before = p.engine.snapshot()
    wrong = CacheHit(((),), 0)  # the pool has a 12-token hit
    (o,) = p.apply(s, [op.Lookup(new("w", list(range(13))), answered=wrong)])  # type: ignore[arg-type]
    assert o.error is not None and o.error.reason is ErrorReason.PREDICTION_FAILED
    assert p.engine.snapshot() == before  # the request sync was undone too
    right = p.engine.find_longest_cache_hit(hashes(list(range(13))), 13)
    (o,) = p.apply(s, [op.Lookup(new("w", list(range(13))), answered=right)])  # type: ignore[arg-type]
    assert o.error is None and o.value == right


def test_must_refuse_is_checked() -> None:
    """A refusal the client answered is applied as usual; if the pool grants it instead,
    PREDICTION_FAILED (the blocks stay with the request, which the client then frees)."""
    p, s = service()
    (o,) = p.apply(s, [op.Allocate(new("big", list(range(100))), 100, must_refuse=True)])  # type: ignore[arg-type]
    assert o.error is None and isinstance(o.value, op.AllocateOutcome) and o.value.new_block_ids is None
    (o,) = p.apply(s, [op.Allocate(new("small", list(range(8))), 8, must_refuse=True)])  # type: ignore[arg-type]
    assert o.error is not None and o.error.reason is ErrorReason.PREDICTION_FAILED
    assert p.engine.get_block_ids("small") != ((),)
    (o,) = p.apply(s, [op.Allocate(new("x", list(range(8))), 8, must_refuse=True, must_succeed=True)])  # type: ignore[arg-type]
    assert o.error is not None and o.error.code is grpc.StatusCode.INVALID_ARGUMENT


def test_free_queue_position_is_a_lower_bound_whatever_the_dead_entries() -> None:
    """Random hits take blocks out of the middle (dead entries, compaction rarely): after
    every change the position reported never exceeds the true one, equals it when
    within the limit, and the walk reads at most ``limit`` entries (the positions read
    are kept until the queue changes: they must never outlive a change)."""
    rnd = random.Random(2)
    pool = full_pool(200)
    fq = pool.block_pool.free_block_queue
    fq.compact_slack = 2  # compact now and then too
    blocks = pool.block_pool.blocks
    prefixes = [[rnd.randrange(1000) for _ in range(n)] for n in (8, 16, 24, 32)]
    checked = 0

    def check() -> int:
        queue = pool.free_queue_head()
        cached = [b for b in queue if b < len(blocks) and blocks[b].cached_hash is not None]
        for bid in rnd.sample(cached, min(5, len(cached))):
            true = queue.index(bid)
            for limit in (1, 5, 50, 10_000):
                got = fq.first_position({bid}, limit)
                assert got <= min(true, limit)
                if limit == 10_000:
                    assert got == true
        return len(cached)

    for i in range(80):
        tokens = rnd.choice(prefixes) + [rnd.randrange(1000) for _ in range(rnd.randint(1, 12))]
        add(pool, f"r{i}", tokens)
        hit = pool.get_computed_blocks(f"r{i}")
        pool.allocate_slots(
            f"r{i}", len(tokens) - hit.num_tokens, hit.num_tokens, None if hit.is_empty else hit
        )
        checked += check()
        if rnd.random() < 0.7:
            pool.free(f"r{i}")
            checked += check()
    assert checked > 500 and fq._compactions > 0, (checked, fq._compactions)


def run_of(entries: list[tuple[str, int, int, list[int], list[bytes], int, int]]) -> op.AllocateRun:
    """(rid, base tokens, base hashes, tokens, hashes, computed, new tokens) per entry."""
    return op.AllocateRun(
        [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries], [e[5] for e in entries],
        [e[6] for e in entries], [0] * len(entries), [len(e[3]) for e in entries], [t for e in entries for t in e[3]],
        [len(e[4]) for e in entries], [h for e in entries for h in e[4]],
    )  # fmt: skip


def test_an_allocate_run_equals_its_allocations_one_by_one() -> None:
    """Decode steps sent as one AllocateRun leave the pool exactly as the same
    AllocateOps (with their syncs and must_succeed) would, with the same new blocks."""
    rnd = random.Random(8)
    one, s1 = service()
    run, s2 = service()
    toks = {f"r{i}": [rnd.randrange(50) for _ in range(rnd.randint(3, 6))] for i in range(3)}
    for p, s in ((one, s1), (run, s2)):
        p.apply(s, [op.Allocate(new(rid, t), len(t)) for rid, t in toks.items()])  # type: ignore[arg-type]
    took = 0
    for _step in range(6):
        entries = []
        for rid in list(toks):
            before, hashes_before = len(toks[rid]), len(hashes(toks[rid]))
            toks[rid] = toks[rid] + [rnd.randrange(50)]
            added = hashes(toks[rid])[hashes_before:]
            entries.append((rid, before, hashes_before, toks[rid][before:], added, before, 1))
        singles = [
            op.Allocate(op.RequestSync(rid, t, h, False, bt, bh, c), n, must_succeed=True)
            for rid, bt, bh, t, h, c, n in entries
        ]
        want = [o.value for o in one.apply(s1, singles)]  # type: ignore[arg-type]
        (got,) = run.apply(s2, [run_of(entries)])  # type: ignore[list-item]
        assert got.error is None and isinstance(got.value, op.RunOutcome)
        assert got.value.num_new_blocks == [len(w.new_block_ids[0]) for w in want]  # type: ignore[union-attr]
        assert got.value.new_block_ids == [b for w in want for b in w.new_block_ids[0]]  # type: ignore[union-attr]
        assert run.engine.snapshot() == one.engine.snapshot()
        took += sum(got.value.num_new_blocks)
    assert took >= 3  # blocks were taken, not only syncs applied


def test_a_bad_allocate_run_is_refused_or_loud() -> None:
    """Columns of different lengths change nothing (INVALID_ARGUMENT); an entry at the
    wrong position is SYNC_MISMATCH; an entry the pool refuses is PREDICTION_FAILED."""
    p, s = service()
    p.apply(s, [op.Allocate(new("a", list(range(8))), 8), op.Allocate(new("b", list(range(8))), 8)])  # type: ignore[arg-type]
    before = p.engine.snapshot()
    bad = run_of([("a", 8, 2, [9], [], 8, 1)])
    bad.num_new_tokens = [1, 1]
    (o,) = p.apply(s, [bad])  # type: ignore[list-item]
    assert o.error is not None and o.error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert p.engine.snapshot() == before
    (o,) = p.apply(s, [run_of([("a", 7, 2, [9], [], 8, 1)])])  # type: ignore[list-item]
    assert o.error is not None and o.error.reason is ErrorReason.SYNC_MISMATCH
    assert p.engine.snapshot() == before
    (o,) = p.apply(s, [run_of([("b", 8, 2, [9], [], 8, 1), ("a", 8, 2, [9], [], 8, 100)])])  # type: ignore[list-item]
    assert o.error is not None and o.error.reason is ErrorReason.PREDICTION_FAILED
    assert p.engine.requests["b"].num_tokens == 9  # the entry before stays applied (documented)
    assert p.engine.requests["a"].num_tokens == 8  # the refused one's sync is undone
    shared, first = service(exclusive=False)
    shared.apply(first, [op.Allocate(new("a", list(range(8))), 8)])  # type: ignore[arg-type]
    other = shared.attach("sha256_cbor", 4, "0", "other", 0)
    (o,) = shared.apply(other, [run_of([("a", 8, 2, [9], [], 8, 1)])])  # type: ignore[list-item]
    assert o.error is not None and o.error.code is grpc.StatusCode.PERMISSION_DENIED
    (o,) = p.apply(s, [run_of([("ghost", 0, 0, [1], [], 0, 1)])])  # type: ignore[list-item]
    assert o.error is not None and o.error.reason is ErrorReason.REQUEST_UNKNOWN


def _take(pool: KVCachePool, rid: str, most: int) -> int:
    """Allocate a fresh request taking as many blocks as it can, at most ``most`` (none
    of its tokens cached anywhere); returns how many blocks left the free queue."""
    specs = pool.config.groups
    tokens = 0
    while sum(-(-(tokens + 1) // s.block_size) for s in specs) <= most:
        tokens += 1
    if not tokens:
        return 0
    before = pool.num_free_blocks
    add(pool, rid, [100_000 + i for i in range(tokens)])
    assert pool.allocate_slots(rid, tokens) is not None
    return before - pool.num_free_blocks


def test_eagle_hint_in_a_hybrid_counts_every_block_the_search_reads() -> None:
    """EAGLE on full attention + sliding window: each pass of the hybrid search drops a
    block the final hit does not show (here the full group's match sets the length the
    sliding search gets), so the margin counts every block cached under the request's
    hashes. With the margin the final lists gave (3), taking 3 blocks shortened the hit
    from 16 to 8 tokens."""

    def scenario() -> KVCachePool:
        pool = KVCachePool(
            KVCacheConfig(
                num_blocks=13, groups=(FullAttentionSpec(4), SlidingWindowSpec(8, 16)), hash_block_size=4,
                max_model_len=256, use_eagle=True,
            )
        )  # fmt: skip
        prompt = list(range(30))
        add(pool, "a", prompt)
        assert pool.allocate_slots("a", 30) is not None
        pool.free("a")
        add(pool, "b", prompt + [99])
        return pool

    pool = scenario()
    hit, margin = pool.lookup_hint("b", walk_limit=1000)
    assert hit.num_tokens == 16 and margin < 3
    assert _take(pool, "x", margin) <= margin
    assert pool.lookup_hint("b")[0] == hit
    old = scenario()
    assert _take(old, "y", 3) == 3  # what the old margin allowed
    assert old.lookup_hint("b")[0].num_tokens == 8


def test_eagle_hint_margin_counts_a_held_dropped_block() -> None:
    """EAGLE on full attention: the block the hit drops may be held when the hint is
    taken and freed later, unseen by a client that knows only the hit's blocks. It then
    waits behind every block free at the hint, so the margin is at most that many;
    taking that many after the free keeps the hit. (The margin was the walk limit:
    the free went unnoticed and the hit lost a block.)"""
    pool = full_pool(24, use_eagle=True)
    prompt = list(range(32))
    add(pool, "a", prompt)  # blocks 1-8, cached, held by a
    assert pool.allocate_slots("a", 32) is not None
    add(pool, "c", prompt + [500])  # adopts 7 of a's blocks, computes one token: caches nothing new
    c_hit = pool.get_computed_blocks("c")
    assert c_hit.num_tokens == 28
    assert pool.allocate_slots("c", 1, c_hit.num_tokens, c_hit) is not None
    add(pool, "b", prompt + [600])
    hit, margin = pool.lookup_hint("b", walk_limit=1000)
    assert hit.num_tokens == 28  # 8 blocks match, EAGLE drops the eighth (held by a)
    free_at_hint = pool.num_free_blocks
    assert margin <= free_at_hint
    pool.free("a")  # only the dropped block reaches the free queue (c holds the rest)
    assert _take(pool, "x", margin) <= margin
    assert pool.lookup_hint("b")[0] == hit
    _take(pool, "y", pool.num_free_blocks)  # the rest, the dropped block last
    assert pool.lookup_hint("b")[0].num_tokens == 24


@pytest.mark.parametrize("use_eagle", [False, True], ids=["plain", "eagle"])
@pytest.mark.parametrize("layout", ["full", "sliding", "full+sliding"])
def test_hint_margins_hold_in_random_pools(layout: str, use_eagle: bool) -> None:
    """Random pools (prefixes shared, requests allocated and freed), then a hint for a
    waiting request: after frees of requests that hold none of the hit's blocks (a
    client follows those through its ledger) and taking ``margin`` blocks, the lookup
    still gives the same hit."""
    groups = {
        "full": (FullAttentionSpec(4),),
        "sliding": (SlidingWindowSpec(4, 12),),
        "full+sliding": (FullAttentionSpec(4), SlidingWindowSpec(8, 16)),
    }[layout]
    checked = 0
    for seed in range(60):
        rnd = random.Random(seed)
        pool = KVCachePool(
            KVCacheConfig(
                num_blocks=rnd.choice((20, 32, 48)), groups=groups, hash_block_size=4, max_model_len=256,
                use_eagle=use_eagle,
            )
        )  # fmt: skip
        prefixes = [[rnd.randrange(1000) for _ in range(n)] for n in (8, 16, 24)]
        running: list[str] = []
        for i in range(30):
            if running and rnd.random() < 0.4:
                pool.free(running.pop(rnd.randrange(len(running))))
                continue
            rid = f"r{i}"
            tokens = rnd.choice(prefixes) + [rnd.randrange(1000) for _ in range(rnd.randint(1, 12))]
            add(pool, rid, tokens)
            hit = pool.get_computed_blocks(rid)
            if pool.allocate_slots(rid, len(tokens) - hit.num_tokens, hit.num_tokens, hit) is not None:
                running.append(rid)
        w = rnd.choice(prefixes) + [rnd.randrange(1000) for _ in range(rnd.randint(1, 12))]
        add(pool, "w", w)
        hit, margin = pool.lookup_hint("w", walk_limit=1000)
        hit_blocks = {b for g in hit.block_ids for b in g if b}
        for rid in list(running):
            if rnd.random() < 0.5 and not hit_blocks & {b for g in pool.get_block_ids(rid) for b in g}:
                pool.free(rid)
                running.remove(rid)
        _take(pool, "x", min(margin, pool.num_free_blocks))
        assert pool.lookup_hint("w")[0] == hit, (seed, hit, margin)
        checked += hit.num_tokens > 0
    assert checked > 10
