"""Divergences of the engine's fast paths from its general path that the differential
fuzz (tests/fastpath_diff.py, tests/unit/test_fast_path_differential.py) found, each
reduced to its smallest case."""

from __future__ import annotations

import pytest
from fastpath_diff import make_general
from kvcoord.engine import FullAttentionSpec, InvalidArgumentError, KVCacheConfig, KVCachePool
from kvcoord.engine.decode_run import DecodeColumns
from kvcoord.engine.state import export_state


@pytest.mark.parametrize("look", [0, 1])
def test_a_decode_run_entry_whose_hash_is_none_is_left_to_the_general_path(look: int) -> None:
    """An entry completing a block with ``None`` for its hash: decode_run took the
    ``None`` for "no hash", appended the token without one, then cached the block and
    failed (IndexError) with the request's token and hash lists out of step. The
    general path refuses it (InvalidArgumentError), changing nothing."""
    pool = KVCachePool(KVCacheConfig(num_blocks=8, groups=(FullAttentionSpec(4),), hash_block_size=4))
    pool.add_request("a", [1] * 7, [b"\x01" * 32])
    assert pool.allocate_slots("a", 7) == ((1, 2),)
    before = export_state(pool)
    cols = DecodeColumns(["a"], [7], [1], [7], [1], [look], [1], [5], [1], [None])  # type: ignore[list-item]
    counts: list[int] = [0]
    ids: list[int] = []
    assert pool.decode_run(cols, 0, 1, 0, 0, counts, ids) == (0, 0, 0)
    assert export_state(pool) == before and counts == [0] and ids == []
    with pytest.raises(InvalidArgumentError, match="block hashes must be non-empty bytes"):
        pool.update_and_allocate("a", 7, [5], [None], 1, look)  # type: ignore[list-item]
    assert export_state(pool) == before


def test_a_chunk_of_a_multi_module_mtp_pool_caches_as_the_general_path() -> None:
    """vllm-0.33 with look-ahead hashes L = 2 (two MTP modules): vLLM 0.33 caches up to
    ``computed - (L - 1)`` tokens (the re-prefillable tail), as allocate_slots' general
    path does; its path without a hit (update_and_allocate's too, and decode_step's and
    decode_run's) cached the tail as well: a prompt's first chunk of 20 tokens cached 5
    blocks where vLLM caches 4 (19 tokens), the next chunk of 4 six where vLLM caches 5."""
    config = KVCacheConfig(
        num_blocks=16, groups=(FullAttentionSpec(4),), hash_block_size=4, profile="vllm-0.33",
        num_hash_lookahead_tokens=2, enable_kv_cache_events=True,
    )  # fmt: skip
    fast, general = KVCachePool(config), make_general(KVCachePool(config))
    for p in (fast, general):
        p.add_request("a", list(range(30)), [bytes([i]) * 32 for i in range(7)])
    for call, args, new, cached in (
        ("allocate_slots", ("a", 20), ((1, 2, 3, 4, 5),), 4),
        ("update_and_allocate", ("a", 20, [], [], 4), ((6,),), 5),
    ):
        assert [getattr(p, call)(*args) for p in (fast, general)] == [new, new]
        assert [p.managers[0].num_cached_block["a"] for p in (fast, general)] == [cached, cached], call
        assert export_state(fast) == export_state(general)
        assert fast.take_events() == general.take_events()
