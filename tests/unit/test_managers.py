"""Single-type managers: semantics.md §4.10, §4.11 and §4.8 worked examples."""

from __future__ import annotations

from typing import Any

import pytest
from kvcoord.engine import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from support import Driver, toks

P = toks(1, 20)


def sliding(**kw: object) -> Driver:
    d = Driver((SlidingWindowSpec(4, 8),), num_blocks=20, **kw)
    d.add("A", P)
    assert d.pool.allocate_slots("A", 20) == ((1, 2, 3, 4, 5),)
    return d


def test_sliding_window_decode_frees_out_of_window_blocks() -> None:
    """skip(20)=13 nulls positions 2,1,0 (freed in that order), then one new block."""
    d = sliding()
    d.append("A", [21], 20)
    assert d.pool.allocate_slots("A", 1) == ((6,),)
    assert d.ids("A") == ((0, 0, 0, 4, 5, 6),)
    assert d.pool.free_queue_head()[-3:] == [3, 2, 1]


def test_sliding_window_hit_shares_window_blocks() -> None:
    """B = P + 1 token hits [0,0,0,4,5] (20 tokens) and needs one new block."""
    d = sliding()
    d.append("A", [21], 20)
    d.pool.allocate_slots("A", 1)
    hit, new = d.admit("B", P + [99])
    assert hit.block_ids == ((0, 0, 0, 4, 5),) and hit.num_tokens == 20
    assert new == ((7,),)
    assert d.ids("B") == ((0, 0, 0, 4, 5, 7),)


def test_sliding_window_runs_after_evictions() -> None:
    """A miss resets the run; a short run touching position 0 is still a hit."""
    d = sliding()
    d.pool.free("A")
    d.pool.evict_blocks([4])
    d.add("B", P + [99])
    hit = d.hit("B")
    assert hit.block_ids == ((0, 2, 3),) and hit.num_tokens == 12
    d.pool.evict_blocks([2])
    assert d.hit("B").block_ids == ((1,),)
    d.add("C", toks(1, 7))
    assert d.hit("C").block_ids == ((1,),)


def test_sliding_window_eagle_needs_one_more_block_then_drops_it() -> None:
    """With EAGLE: [0,0,3,4,5] is found, then the last block is dropped (16 tokens)."""
    d = sliding(use_eagle=True)
    d.pool.free("A")
    d.add("B", P + [99])
    hit = d.hit("B")
    assert hit.block_ids == ((0, 0, 3, 4),) and hit.num_tokens == 16


def test_mamba_all_keeps_only_last_state() -> None:
    """Decoding nulls every earlier position; hits are a null prefix plus one block."""
    d = Driver((MambaSpec(4, MambaCacheMode.ALL),), num_blocks=20)
    d.add("A", P)
    assert d.pool.allocate_slots("A", 20) == ((1, 2, 3, 4, 5),)
    d.append("A", [21], 20)
    d.pool.allocate_slots("A", 1)
    assert d.ids("A") == ((0, 0, 0, 0, 5, 6),)
    d.add("B", P + [99])
    hit = d.hit("B")
    assert hit.block_ids == ((0, 0, 0, 0, 5),) and hit.num_tokens == 20
    d.add("C", toks(1, 8) + toks(100, 110))
    assert d.hit("C").block_ids == ((0, 2),)


def test_mamba_speculative_blocks() -> None:
    """Modes none/all allocate S extra blocks: bs 16, S 2, 20 tokens -> 4 blocks."""
    d = Driver((MambaSpec(16, MambaCacheMode.ALL, 2),), num_blocks=20, hash_block_size=16)
    d.add("A", toks(1, 20))
    assert d.pool.allocate_slots("A", 20) == ((1, 2, 3, 4),)


def test_chunked_local_hit_without_cached_blocks() -> None:
    """Positions before the current chunk are a hit of null blocks (c=8, bs=4)."""
    d = Driver((ChunkedLocalAttentionSpec(4, 8),), num_blocks=20)
    d.add("A", toks(1, 16))
    hit = d.hit("A")
    assert hit.block_ids == ((0, 0),) and hit.num_tokens == 8
    d.add("B", toks(1, 17))
    assert d.hit("B").block_ids == ((0, 0, 0, 0),)
    hit, new = d.admit("C", P)
    assert hit.num_tokens == 16 and new == ((1,),)


def test_mamba_align_mode_verified_trace() -> None:
    """full(4) + mamba(4, align, S=1), 10-token prompt in chunks of 8 and 2 (§4.11)."""
    d = Driver((FullAttentionSpec(4), MambaSpec(4, MambaCacheMode.ALIGN, 1)), num_blocks=20)
    d.add("A", toks(1, 10))
    assert d.pool.allocate_slots("A", 8) == ((1, 2), (0, 3, 4))
    d.append("A", [], 8)
    assert d.pool.allocate_slots("A", 2) == ((5,), (6,))
    assert d.ids("A") == ((1, 2, 5), (0, 3, 4, 6))
    d.append("A", [11], 10)
    assert d.pool.allocate_slots("A", 1) == ((), ())
    assert d.ids("A") == ((1, 2, 5), (0, 0, 4, 6))


def test_common_prefix_blocks() -> None:
    """A, B, C hold [1,2,3], [1,2,4], [1,2,5] -> 2 shared blocks (§4.8)."""
    d = Driver((FullAttentionSpec(4),), num_blocks=20)
    d.admit("A", toks(1, 12))
    d.admit("B", toks(1, 8) + toks(201, 204))
    d.admit("C", toks(1, 8) + toks(301, 304))
    assert [d.ids(r)[0] for r in "ABC"] == [(1, 2, 3), (1, 2, 4), (1, 2, 5)]
    assert d.pool.get_num_common_prefix_blocks("A") == (2,)


@pytest.mark.parametrize(
    ("groups", "kw", "lone"),
    [
        ((FullAttentionSpec(4),), {}, True),
        ((FullAttentionSpec(4),), {"enable_caching": False}, False),  # the no-cache coordinator: zeros
        ((FullAttentionSpec(4),), {"profile": "vllm-0.33"}, False),  # zeros by the profile's rule
        ((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), {}, False),
    ],
    ids=["full", "no-caching", "033", "full+swa"],
)
def test_the_lone_common_prefix_read_is_the_pools_own(groups: Any, kw: Any, lone: bool) -> None:
    """``lone_common_prefix`` (the predicted mirror's read, every scheduler step) is the
    one manager's count only where the pool's own answer is that count, and equals it."""
    d = Driver(groups, num_blocks=40, **kw)
    d.admit("A", toks(1, 12))
    d.admit("B", toks(1, 8) + toks(201, 204))
    read = d.pool.lone_common_prefix()
    assert (read is not None) == lone
    if read is not None:
        for rid in "AB":
            assert (read(rid),) == d.pool.get_num_common_prefix_blocks(rid) == (2,)


def test_sink_attention_holds_blocks_forever() -> None:
    """A sink group pops sink_len/bs blocks at creation; they count as used (§4.12)."""
    d = Driver((FullAttentionSpec(4, sink_len=8),), num_blocks=10)
    assert d.pool.num_free_blocks == 7
    assert d.pool.free_queue_head() == [3, 4, 5, 6, 7, 8, 9]
    assert d.pool.reset_prefix_cache() is False
