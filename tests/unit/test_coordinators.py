"""Coordinators and the facade: semantics.md §5.1, §5.5 and §6.2 worked examples."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kvcoord.engine import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    ConfigError,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from support import Driver, toks

P = toks(1, 30)


def hybrid(groups: Sequence[AttentionSpec], evict: Sequence[int] = (), **kw: object) -> Driver:
    """A prefills P (30 tokens) and is freed; then ``evict`` block ids lose their hash."""
    d = Driver(tuple(groups), num_blocks=60, **kw)
    d.add("A", P)
    assert d.pool.allocate_slots("A", 30) is not None
    d.pool.free("A")
    d.pool.evict_blocks(list(evict))
    d.add("B", P + [99])
    return d


FULL4 = FullAttentionSpec(4)
SW8_16 = SlidingWindowSpec(8, 16)


def test_h1_simple_hybrid() -> None:
    """full(4) + sliding(8, w16): hit aligned to lcm 8 -> ([1..6],[0,10,11]), 24."""
    hit = hybrid((FULL4, SW8_16)).hit("B")
    assert hit.block_ids == ((1, 2, 3, 4, 5, 6), (0, 10, 11)) and hit.num_tokens == 24


def test_h1_after_sliding_eviction_truncates_full() -> None:
    """Evicting sliding block 11 gives ([1,2,3,4],[9,10]), 16 after the final truncation."""
    hit = hybrid((FULL4, SW8_16), evict=[11]).hit("B")
    assert hit.block_ids == ((1, 2, 3, 4), (9, 10)) and hit.num_tokens == 16


def test_h1_eagle() -> None:
    """With EAGLE each type drops a block once: ([1..4],[9,10]), 16."""
    hit = hybrid((FULL4, SW8_16), use_eagle=True).hit("B")
    assert hit.block_ids == ((1, 2, 3, 4), (9, 10)) and hit.num_tokens == 16


H3 = (FULL4, SW8_16, SlidingWindowSpec(8, 32))


def test_h3_fixed_point_without_evictions() -> None:
    """Three attention types, nothing evicted: ([1..6],[0,10,11],[13,14,15]), 24."""
    hit = hybrid(H3).hit("B")
    assert hit.block_ids == ((1, 2, 3, 4, 5, 6), (0, 10, 11), (13, 14, 15)) and hit.num_tokens == 24


def test_h3_fixed_point_shrinks_to_zero() -> None:
    """Evicting sw16 position 0 and sw32 position 1 drives the fixed point to 0."""
    hit = hybrid(H3, evict=[9, 14]).hit("B")
    assert hit.block_ids == ((), (), ()) and hit.num_tokens == 0


def test_h4_eagle_spiral() -> None:
    """H3's layout with EAGLE: each pass drops another block until the hit is 0."""
    hit = hybrid(H3, use_eagle=True).hit("B")
    assert hit.num_tokens == 0


def test_h5_identical_specs_share_an_attention_group() -> None:
    """Two equal sliding groups are searched together; a hit needs both keys."""
    sw = SlidingWindowSpec(4, 8)
    hit = hybrid((FULL4, sw, sw)).hit("B")
    assert hit.block_ids == (
        (1, 2, 3, 4, 5, 6, 7),
        (0, 0, 0, 0, 0, 14, 15),
        (0, 0, 0, 0, 0, 22, 23),
    )
    assert hit.num_tokens == 28


def test_full_plus_mamba() -> None:
    """full(4) + mamba(8, all) -> ([1..6],[0,0,11]), 24."""
    hit = hybrid((FULL4, MambaSpec(8, MambaCacheMode.ALL))).hit("B")
    assert hit.block_ids == ((1, 2, 3, 4, 5, 6), (0, 0, 11)) and hit.num_tokens == 24


def test_sliding_plus_mamba_without_full_attention() -> None:
    """No full attention (not simple): ([0,0,0,0,0,6,7],[0,0,0,0,0,0,15]), 28."""
    hit = hybrid((SlidingWindowSpec(4, 8), MambaSpec(4, MambaCacheMode.ALL))).hit("B")
    assert hit.block_ids == ((0, 0, 0, 0, 0, 6, 7), (0, 0, 0, 0, 0, 0, 15)) and hit.num_tokens == 28


def test_sliding_then_full_is_searched_full_first() -> None:
    """Config order sliding-then-full gives the same hit as full-then-sliding, per group."""
    a = hybrid((FULL4, SW8_16)).hit("B")
    b = hybrid((SW8_16, FULL4)).hit("B")
    assert b.num_tokens == a.num_tokens == 24
    assert len(b.block_ids[1]) == 6 and len(b.block_ids[0]) == 3


def test_second_distinct_full_spec_keeps_longer_list() -> None:
    """Quirk: only the first attention group is truncated (§5.4 verified example)."""
    d = Driver((FullAttentionSpec(4), FullAttentionSpec(4, num_kv_heads=2), SW8_16), num_blocks=60)
    d.add("A", P)
    d.pool.allocate_slots("A", 30)
    d.pool.free("A")
    d.pool.evict_blocks([17 + 2])  # sliding position 2
    d.add("B", P + [99])
    hit = d.hit("B")
    assert hit.block_ids == ((1, 2, 3, 4), (9, 10, 11, 12, 13, 14), (17, 18)) and hit.num_tokens == 16


def test_group_order_fan_out() -> None:
    """New ids are taken group 0 first; free appends group 0's blocks (reversed) first."""
    d = Driver((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), num_blocks=20)
    d.add("A", toks(1, 10))
    assert d.pool.allocate_slots("A", 10) == ((1, 2, 3), (4, 5, 6))
    d.pool.free("A")
    assert d.pool.free_queue_head()[-6:] == [3, 2, 1, 6, 5, 4]


def test_cross_attention_static_allocation() -> None:
    """Cross-attention gets cdiv(encoder tokens, bs) blocks once, never more."""
    d = Driver((FullAttentionSpec(4), CrossAttentionSpec(4)), num_blocks=20, enable_caching=False)
    d.add("A", toks(1, 6))
    assert d.pool.allocate_slots("A", 6, num_encoder_tokens=10) == ((1, 2), (3, 4, 5))
    d.append("A", [7], 6)
    assert d.pool.allocate_slots("A", 1) == ((), ())


def test_refusal_counts_evictable_hit_blocks() -> None:
    """A hit on free cached blocks costs free slots: 2 new + 2 evictable > 3 -> None."""
    d = Driver((FullAttentionSpec(4),), num_blocks=6)
    d.add("A", toks(1, 10))
    d.pool.allocate_slots("A", 10)
    d.pool.free("A")
    d.add("X", toks(101, 108))
    d.pool.allocate_slots("X", 8)
    assert d.pool.free_queue_head() == [3, 2, 1]
    d.add("B", toks(1, 13))
    hit = d.hit("B")
    assert hit.block_ids == ((1, 2),)
    before = d.pool.snapshot()
    assert d.pool.allocate_slots("B", 5, 8, hit) is None
    assert d.pool.snapshot() == before


def test_refusal_after_skipped_block_removal() -> None:
    """Skipped blocks are released before the free check, so they stay released on None."""
    d = Driver((SlidingWindowSpec(4, 8),), num_blocks=8)
    d.add("A", toks(1, 44))
    assert d.pool.allocate_slots("A", 20) == ((1, 2, 3, 4, 5),)
    d.append("A", [], 20)
    assert d.pool.allocate_slots("A", 24) is None
    assert d.pool.free_queue_head() == [6, 7, 3, 2, 1]
    assert d.pool.allocate_slots("A", 12) == ((6, 7, 3),)


def test_external_tokens_with_delayed_caching() -> None:
    """External blocks are not in the result; delayed caching caches nothing yet."""
    d = Driver((FullAttentionSpec(4),), num_blocks=20, enable_kv_cache_events=True)
    d.add("A", toks(1, 20))
    assert d.pool.allocate_slots("A", 0, num_external_computed_tokens=12, delay_cache_blocks=True) == ((),)
    assert d.ids("A") == ((1, 2, 3),)
    assert d.pool.take_events() == []
    d.pool.cache_blocks("A", 12)
    assert len(d.pool.take_events()) == 1


def test_lookahead_slots_are_allocated_but_drafts_not_cached() -> None:
    """Lookahead grows the table; cached count is capped at the request's tokens."""
    d = Driver((FullAttentionSpec(4),), num_blocks=20)
    d.add("A", toks(1, 10))
    assert d.pool.allocate_slots("A", 10, num_lookahead_tokens=3) == ((1, 2, 3, 4),)
    d.append("A", [11], 10)
    assert d.pool.allocate_slots("A", 4, num_lookahead_tokens=3) == ((5,),)
    assert d.pool.managers[0].num_cached_block["A"] == 2


def test_max_model_len_caps_slots() -> None:
    """max_model_len 12, 10 tokens, lookahead 5 -> 12 slots -> 3 blocks."""
    d = Driver((FullAttentionSpec(4),), num_blocks=20, max_model_len=12)
    d.add("A", toks(1, 10))
    assert d.pool.allocate_slots("A", 10, num_lookahead_tokens=5) == ((1, 2, 3),)


@pytest.mark.parametrize(
    ("groups", "kw", "message"),
    [
        ((), {}, "at least one KV cache group"),
        ((FullAttentionSpec(8),), {}, "hash_block_size == block_size"),
        ((FULL4, SlidingWindowSpec(6, 16)), {}, "not a multiple of hash_block_size"),
        ((FULL4, FULL4), {}, "two distinct attention specs"),
        ((FULL4, CrossAttentionSpec(4)), {}, "cross-attention"),
        ((FULL4, ChunkedLocalAttentionSpec(4, 8)), {"use_eagle": True}, "EAGLE"),
        ((FULL4, ChunkedLocalAttentionSpec(4, 16), SlidingWindowSpec(8, 16)), {}, "LCM"),
        ((FULL4, SlidingWindowSpec(4, 16), MambaSpec(8)), {"use_eagle": True}, "LCM"),
        ((FULL4,), {"dcp_world_size": 2}, "context parallelism"),
        ((FullAttentionSpec(4, sink_len=6),), {}, "multiple of block_size"),
        ((FULL4,), {"num_blocks": 0}, "num_blocks"),
    ],
)
def test_rejected_layouts(groups: tuple[AttentionSpec, ...], kw: dict[str, object], message: str) -> None:
    """Layouts vLLM would reject (at creation or first lookup) fail at creation, naming the rule."""
    args: dict[str, object] = {"num_blocks": 10, "groups": groups, "hash_block_size": 4}
    args.update(kw)
    with pytest.raises(ConfigError, match=message):
        KVCacheConfig(**args)  # type: ignore[arg-type]


def test_caching_off_accepts_cross_attention_and_no_groups() -> None:
    """Without caching any layout, even zero groups, is served."""
    KVCacheConfig(num_blocks=10, groups=(), hash_block_size=4, enable_caching=False)
    KVCacheConfig(
        num_blocks=10, groups=(FULL4, CrossAttentionSpec(4)), hash_block_size=4, enable_caching=False
    )
