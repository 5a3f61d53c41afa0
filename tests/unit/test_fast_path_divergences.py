"""Divergences of the engine's fast paths from its general path that the differential
fuzz (tests/fastpath_diff.py, tests/unit/test_fast_path_differential.py) found, each
reduced to its smallest case."""

from __future__ import annotations

import pytest
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
