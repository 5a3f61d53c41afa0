"""Block pool and unitary full attention: semantics.md §3.9 worked example P."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
from kvcoord.engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FullAttentionSpec,
    RequestNotFoundError,
    SlidingWindowSpec,
    hash_to_int64,
)
from kvcoord.engine.blocks import KVCacheBlock
from kvcoord.engine.free_queue import FreeKVCacheBlockQueue
from kvcoord.engine.invariants import check_pool
from support import Driver, toks


def example_p() -> tuple[Driver, list[bytes]]:
    d = Driver((FullAttentionSpec(4),), num_blocks=10, enable_kv_cache_events=True)
    hashes = d.add("A", toks(1, 10))
    assert d.hit("A").num_tokens == 0
    assert d.pool.allocate_slots("A", 10) == ((1, 2, 3),)
    return d, hashes


def test_fresh_pool() -> None:
    """A fresh pool has ids 1..N-1 free in order and zero usage; the null block is hidden."""
    d = Driver(num_blocks=10)
    assert d.pool.free_queue_head() == list(range(1, 10))
    assert d.pool.num_free_blocks == 9
    assert d.pool.usage == 0.0


def test_example_p_allocation_caching_and_events() -> None:
    """Steps 2-3: first allocation caches two full blocks, a decode step caches the third."""
    d, h = example_p()
    assert d.pool.free_queue_head() == [4, 5, 6, 7, 8, 9]
    assert d.pool.usage == 1.0 - 6 / 9
    ev = d.pool.take_events()
    assert ev == [BlockStored((h[0], h[1]), None, tuple(toks(1, 8)), 4, None, None)]
    d.append("A", [11], 10)
    assert d.pool.allocate_slots("A", 1) == ((),)
    assert d.pool.take_events() == []
    h2 = d.append("A", [12], 11)
    assert d.pool.allocate_slots("A", 1) == ((),)
    assert d.pool.take_events() == [BlockStored((h2[0],), h[1], tuple(toks(9, 12)), 4, None, None)]


def test_example_p_free_order_hits_and_duplicate_keys() -> None:
    """Steps 4-7: reverse-order free, hit adoption, a second block under one key, refusal."""
    d, h = example_p()
    d.pool.free("A")
    assert d.pool.free_queue_head() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    hit, new = d.admit("B", toks(1, 10))
    assert hit.block_ids == ((1, 2),) and hit.num_tokens == 8
    assert new == ((4,),)
    assert d.ids("B") == ((1, 2, 4),)
    assert d.pool.free_queue_head() == [5, 6, 7, 8, 9, 3]
    hit, new = d.admit("C", toks(1, 8))
    assert hit.block_ids == ((1,),) and hit.num_tokens == 4
    assert new == ((5,),)
    d.add("X", toks(1, 8))
    assert d.hit("X").block_ids == ((1,),)  # capped at 7 tokens: block 2 unusable
    # key h1 now maps to blocks {2, 5}: lookups keep returning 2 until it is evicted.
    d.add("Y", toks(1, 9))
    assert d.hit("Y").block_ids == ((1, 2),)
    d.pool.evict_blocks([2])
    assert d.hit("Y").block_ids == ((1, 5),)
    d.add("D", toks(1, 24))
    snap = d.pool.snapshot()
    assert d.pool.allocate_slots("D", 24) is None
    assert d.pool.snapshot() == snap
    stats = d.pool.make_prefix_cache_stats()
    assert stats is not None
    # lookups: A, B, C (example P) + X, Y twice
    assert (stats.requests, stats.queries, stats.hits) == (6, 10 + 10 + 8 + 8 + 9 + 9, 0 + 8 + 4 + 4 + 8 + 8)


def test_eviction_emits_removed_before_stored_and_reset() -> None:
    """Reusing a cached block emits BlockRemoved first; reset is refused while blocks are held."""
    d = Driver((FullAttentionSpec(4),), num_blocks=10, enable_kv_cache_events=True)
    h = d.add("A", toks(1, 10))
    d.pool.allocate_slots("A", 10)
    d.pool.free("A")
    d.pool.take_events()
    d.add("E", toks(101, 132))
    assert d.pool.allocate_slots("E", 32) == ((4, 5, 6, 7, 8, 9, 3, 2),)
    ev = d.pool.take_events()
    assert ev[0] == BlockRemoved((h[1],))
    assert isinstance(ev[1], BlockStored) and len(ev[1].block_hashes) == 8 and ev[1].parent_block_hash is None
    assert d.pool.reset_prefix_cache() is False
    d.pool.free("E")
    assert d.pool.reset_prefix_cache() is True
    assert d.pool.take_events() == [AllBlocksCleared()]
    assert d.pool.free_queue_head() == [1, 2, 3, 9, 8, 7, 6, 5, 4]
    stats = d.pool.make_prefix_cache_stats()
    assert stats is not None and stats.reset is True


def test_event_hash_integer_form() -> None:
    """Event hashes become the low 64 bits, big-endian (§3.8 example)."""
    h = bytes.fromhex("c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb")
    assert hash_to_int64(h) == 2164874634404590027


def test_usage_float_order() -> None:
    """usage is 1 - free/(N-1), not (N-1-free)/(N-1) (they differ in the last bit)."""
    d = Driver(num_blocks=120)
    d.add("A", toks(1, 96))
    d.pool.allocate_slots("A", 96)
    assert d.pool.num_free_blocks == 95
    assert d.pool.usage == 0.2016806722689075


def test_free_queue_o1_operations() -> None:
    """The free queue pops from the head, appends at the tail and unlinks from the middle;
    never-used ids come first, in order, and their blocks are created only when popped."""
    blocks: list[KVCacheBlock] = []
    q = FreeKVCacheBlockQueue(6, blocks)
    assert q.popleft().block_id == 0
    first = q.popleft_n(3)
    assert [b.block_id for b in first] == [1, 2, 3] and len(blocks) == 4
    q.append(first[2])
    q.append(first[0])
    q.remove(first[2])
    assert q.head_ids() == [4, 5, 1]
    assert q.head_ids(2) == [4, 5] and q.head_ids(3) == [4, 5, 1]
    assert [b.block_id for b in q.popleft_n(3)] == [4, 5, 1]
    assert len(q) == 0 and len(blocks) == 6


def test_free_queue_matches_a_plain_list_through_compactions() -> None:
    """Thousands of pops, appends and removals from the middle (enough to compact the
    queue's list many times) keep exactly the order a plain list gives."""
    rnd = random.Random(5)
    blocks: list[KVCacheBlock] = []
    q = FreeKVCacheBlockQueue(300, blocks)
    model = list(range(300))
    held: list[KVCacheBlock] = []
    for _ in range(40_000):
        roll = rnd.random()
        if roll < 0.45 and len(model) > 0:
            _pop_some(q, rnd, model, held)
        elif roll < 0.9 and held:
            _free_one(q, rnd, model, held)
        elif len(model) > len(held) and model and model[-1] < len(blocks):
            bid = rnd.choice([i for i in model if i < len(blocks)])
            q.remove(blocks[bid])
            model.remove(bid)
            held.append(blocks[bid])
        assert len(q) == len(model)
    assert q.head_ids() == model
    assert q.head_ids(7) == model[:7]
    # A block freed and hit again and again leaves dead entries behind until the list
    # is compacted; the order stays exact throughout.
    b = held.pop()
    for i in range(10_000):
        q.append(b)
        if i % 3 == 0:
            model.append(b.block_id)
            assert q.head_ids()[-1] == b.block_id
            model.remove(b.block_id)
        q.remove(b)
        assert len(q) == len(model)
    assert q.head_ids() == model
    assert [x.block_id for x in q.popleft_n(len(model))] == model


def _pop_some(
    q: FreeKVCacheBlockQueue, rnd: random.Random, model: list[int], held: list[KVCacheBlock]
) -> None:
    """Take 1-8 blocks from the queue's head, checked against the plain-list ``model``."""
    n = rnd.randint(1, min(8, len(model)))
    got = q.popleft_n(n)
    assert [b.block_id for b in got] == model[:n]
    del model[:n]
    held += got


def _free_one(
    q: FreeKVCacheBlockQueue, rnd: random.Random, model: list[int], held: list[KVCacheBlock]
) -> None:
    """Free one held block (any of them) to the queue's tail, and to ``model``'s."""
    b = held.pop(rnd.randrange(len(held)))
    q.append(b)
    model.append(b.block_id)


@pytest.mark.parametrize("seed", range(6))
def test_free_queue_materialized_midway_keeps_the_order(seed: int) -> None:
    """Blocks made all at once (``materialize``, as the client's mirror does at attach)
    at any moment (after pops, frees, removals leaving dead entries, blocks prepended
    ahead) leave the queue in exactly the order a plain list gives, before and after,
    and no block is made again later: the same objects are handed out."""
    rnd = random.Random(seed)
    blocks: list[KVCacheBlock] = []
    q = FreeKVCacheBlockQueue(200, blocks)
    model = list(range(200))
    held: list[KVCacheBlock] = []
    made: list[KVCacheBlock] = []
    # made once some never-used blocks are left and freed ones wait behind them
    made_after = rnd.randrange(20, 120)
    for step in range(4_000):
        fresh = q.next_fresh
        if not made and fresh >= made_after and len(model) > 200 - fresh:
            assert q.materialize() == 200 - fresh > 0 and q.materialize() == 0
            assert [b.block_id for b in blocks] == list(range(200)) and q.next_fresh == 200
            made = list(blocks)
        roll = rnd.random()
        if roll < 0.4 and model:
            _pop_some(q, rnd, model, held)
        elif roll < 0.8 and held:
            _free_one(q, rnd, model, held)
        elif roll < 0.9 and held:  # (the vllm-0.33 profile's prepended frees)
            k = rnd.randint(1, min(3, len(held)))
            back, held = held[:k], held[k:]
            q.prepend_n(back)
            model[:0] = [b.block_id for b in back]
        elif model and [i for i in model if i < len(blocks)] and not q.front_ids():
            bid = rnd.choice([i for i in model if i < len(blocks)])
            q.remove(blocks[bid])
            model.remove(bid)
            held.append(blocks[bid])
        assert len(q) == len(model)
        if step % 97 == 0:
            assert q.head_ids() == model
    assert q.head_ids() == model
    assert made and blocks == made and all(x is y for x, y in zip(blocks, made, strict=True))


def test_huge_pool_is_created_lazily_and_reclaimed_without_gc() -> None:
    """A 5,000,000-block pool creates only the blocks it uses (the null block first), reports
    exact free counts and queue order, and is reclaimed by reference counting alone."""
    gc.disable()
    try:
        d = Driver(
            (FullAttentionSpec(16), SlidingWindowSpec(16, 64)), num_blocks=5_000_000, hash_block_size=16
        )
        bp = d.pool.block_pool
        assert len(bp.blocks) == 1  # the null block
        assert d.pool.num_free_blocks == 4_999_999 and d.pool.usage == 0.0
        assert d.pool.free_queue_head(3) == [1, 2, 3]
        hit, new = d.admit("A", list(range(100)))
        assert hit.num_tokens == 0 and new == ((1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14))
        assert len(bp.blocks) == 15
        d.pool.free("A")
        assert d.pool.num_free_blocks == 4_999_999
        assert d.pool.free_queue_head(3) == [15, 16, 17]
        assert d.pool.cached_block_ids() == list(range(1, 7)) + list(range(8, 14))
        hit, _ = d.admit("B", list(range(100)))
        assert hit.num_tokens == 96 and len(bp.blocks) == 17  # one new block per group
        assert d.pool.find_longest_cache_hit(d.pool.get_request("B").block_hashes, 100) == hit
        ref = weakref.ref(bp)
        del d, bp, hit
        assert ref() is None
    finally:
        gc.enable()


def test_teardown_releases_a_used_pool_in_bounded_slices() -> None:
    """Deleting a pool whose blocks were all used frees them a slice at a time (so a
    server can interleave other calls), and leaves nothing behind."""
    from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool

    pool = KVCachePool(KVCacheConfig(num_blocks=40_001, groups=(FullAttentionSpec(16),), hash_block_size=16,
                                     enable_caching=False, max_model_len=1 << 30))  # fmt: skip
    for i in range(4):
        pool.add_request(f"r{i}", [1] * (9_000 * 16))
        assert pool.allocate_slots(f"r{i}", 9_000 * 16) is not None
    blocks = pool.block_pool.blocks
    assert len(blocks) == 36_001
    sizes = []
    for _ in pool.teardown(chunk=5_000):
        sizes.append(len(blocks))
    assert len(sizes) >= 36_001 // 5_000  # many slices, none larger than the chunk
    assert all(a - b <= 5_000 for a, b in zip([36_001, *sizes], sizes, strict=False))
    assert blocks == [] and pool.requests == {}


def test_teardown_drops_requests_and_cached_keys_in_slices() -> None:
    """A deleted pool's requests (each with its block hashes) are dropped one per slice
    and its cached keys ``chunk`` at a time: each used to go at once (a filled
    1,000,000-block pool's keys held a server's loop ~30 ms)."""
    from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool

    pool = KVCachePool(KVCacheConfig(num_blocks=24_001, groups=(FullAttentionSpec(16),), hash_block_size=16,
                                     max_model_len=1 << 30))  # fmt: skip
    for i in range(4):
        hashes = [f"{i}-{k}".encode() for k in range(6_000)]  # (cached: 6,000 keys each)
        pool.add_request(f"r{i}", [i + 1] * (6_000 * 16), hashes)
        assert pool.allocate_slots(f"r{i}", 6_000 * 16) is not None
    keys = pool.block_pool.cached_block_hash_to_block.first[0]
    assert len(keys) == 24_000
    seen = []  # (requests, cached keys) at each yield
    for _ in pool.teardown(chunk=1_000):
        seen.append((len(pool.requests), len(keys)))
    assert [r for r, _ in seen if r] == [4, 4, 4, 4, 3, 2, 1]  # four tables, then one request a slice
    assert all(
        a - b <= 1_000 for a, b in zip([24_000] + [k for _, k in seen], [k for _, k in seen], strict=False)
    )
    assert keys == {} and pool.requests == {}


@pytest.mark.parametrize("uncomputed_from", [4, 6])
def test_an_undone_steps_free_drops_the_hashes_of_blocks_never_computed(uncomputed_from: int) -> None:
    """``free(uncomputed_from=...)`` (an undone step's free): the cache entries of the
    request's blocks holding a position at or past that token are dropped before the
    release (BlockRemoved told); the blocks below keep theirs. Blocks of 4 tokens: the
    allocation of 13 tokens cached 3 full blocks; from token 4 or 6 on, blocks 2 and 3
    lose their hashes, so the same prompt hits only the first block."""
    d = Driver((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), num_blocks=20, enable_kv_cache_events=True)
    h = d.add("A", toks(1, 13))
    assert d.pool.allocate_slots("A", 13) == ((1, 2, 3, 4), (5, 6, 7, 8))
    d.pool.take_events()
    d.pool.free("A", uncomputed_from=uncomputed_from)
    assert d.pool.take_events() == [
        BlockRemoved((h[1],)),
        BlockRemoved((h[2],)),
        BlockRemoved((h[1],)),
        BlockRemoved((h[2],)),
    ]
    d.add("B", toks(1, 13))
    assert d.hit("B").num_tokens == 4
    assert "A" not in d.pool.requests


def test_an_undone_steps_free_of_an_unknown_request_changes_nothing() -> None:
    """A refused free (an unknown request) drops no hash."""
    d = Driver((FullAttentionSpec(4),), num_blocks=10, enable_kv_cache_events=True)
    d.add("A", toks(1, 9))
    d.pool.allocate_slots("A", 9)
    d.pool.take_events()
    with pytest.raises(RequestNotFoundError):
        d.pool.free("Z", uncomputed_from=0)
    assert d.pool.take_events() == []
    d.pool.free("A", uncomputed_from=8)  # no full block past token 8: nothing dropped
    assert d.pool.take_events() == []
    d.add("B", toks(1, 9))
    assert d.hit("B").num_tokens == 8


def test_an_abandoned_requests_free_drops_the_hashes_of_the_blocks_only_it_holds() -> None:
    """``free_abandoned`` (a session ended holding the request: its worker may never
    have written the blocks its last allocations cached): the cache entries of the
    blocks no other request holds are dropped before the release (BlockRemoved told,
    both groups, the sliding window's null blocks skipped); a block another request
    holds keeps its entry; block ids and the free count are a plain free's; an
    unknown request is refused and nothing changes."""
    d = Driver((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), num_blocks=30, enable_kv_cache_events=True)
    h = d.add("A", toks(1, 17))
    d.pool.allocate_slots("A", 17)  # 4 full blocks cached per group
    hit, _ = d.admit("B", toks(1, 9) + [99])  # B hits A's first 2 blocks
    assert hit.num_tokens == 8
    d.pool.take_events()
    with pytest.raises(RequestNotFoundError):
        d.pool.free_abandoned("Z")
    assert d.pool.take_events() == []
    free_before = d.pool.num_free_blocks
    d.pool.free_abandoned("A")
    removed = d.pool.take_events()
    assert sorted(e.block_hashes for e in removed) == sorted([(h[2],), (h[3],)] * 2)  # type: ignore[attr-defined]
    assert "A" not in d.pool.requests
    d.add("C", toks(1, 17))
    assert d.hit("C").num_tokens == 8
    plain = Driver(
        (FullAttentionSpec(4), SlidingWindowSpec(4, 8)), num_blocks=30, enable_kv_cache_events=True
    )
    plain.add("A", toks(1, 17))
    plain.pool.allocate_slots("A", 17)
    plain.admit("B", toks(1, 9) + [99])
    plain.pool.free("A")
    assert d.pool.num_free_blocks == plain.pool.num_free_blocks > free_before
    assert d.pool.get_block_ids("B") == plain.pool.get_block_ids("B")
    # no live request holds a block it unhashed: every invariant holds in full (unlike
    # after evict_blocks, whose flag would weaken two of them)
    assert not d.pool.evict_blocks_called
    assert check_pool(d.pool).violations == ()


def test_an_undone_steps_deferred_free_drops_the_hashes_at_the_take() -> None:
    """``drop_uncomputed`` (vLLM 0.33's deferred free, at the take, of an undone step):
    the hashes of the request's blocks from that token on are dropped (BlockRemoved
    told) and the blocks stay held until the free; an unknown request is refused."""
    d = Driver((FullAttentionSpec(4),), num_blocks=10, enable_kv_cache_events=True)
    h = d.add("A", toks(1, 13))
    assert d.pool.allocate_slots("A", 13) == ((1, 2, 3, 4),)
    d.pool.take_events()
    with pytest.raises(RequestNotFoundError):
        d.pool.drop_uncomputed("Z", 0)
    d.pool.drop_uncomputed("A", 4)
    assert d.pool.take_events() == [BlockRemoved((h[1],)), BlockRemoved((h[2],))]
    assert d.ids("A") == ((1, 2, 3, 4),)
    d.add("B", toks(1, 13))
    assert d.hit("B").num_tokens == 4
