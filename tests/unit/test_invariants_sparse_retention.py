"""check_pool on vllm-0.33 pools with sparse retention (``prefix_cache_retention_interval``
0, vLLM 0.33's default): a sliding-window or mamba group's caching step counts every newly
full block as cached but hashes only those its retention keeps, so a live block without a
hash below a request's cached count is vLLM 0.33.0's own state (its manager holds the same
tables and hashes the same blocks: tests/with_vllm/test_mamba_external_vs_vllm.py) and is
no violation. A block hashed under another key than the request's at a cached position is
still one, and so is an unhashed one wherever retention is dense or the group is full
attention, except the window blocks dense retention itself leaves unhashed (a window
shorter than a scheduler block: only the blocks ending each scheduler block are kept).
"""

from __future__ import annotations

from typing import Any

from kvcoord.engine import KVCacheConfig, KVCachePool
from kvcoord.engine.invariants import check_pool
from kvcoord.engine.specs import (
    AttentionSpec,
    FullAttentionSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from unit.test_mamba_external import hashes

MAMBA = MambaSpec(4, MambaCacheMode.ALIGN, 0)


def pool(num_blocks: int, second: AttentionSpec = MAMBA, retention: int | None = 0) -> KVCachePool:
    more: dict[str, Any] = {"prefix_cache_retention_interval": retention}
    return KVCachePool(
        KVCacheConfig(
            num_blocks, (FullAttentionSpec(4), second), 4, max_model_len=64,
            profile="vllm-0.33", max_in_flight_tokens=1024, **more,
        )
    )  # fmt: skip


def cached_at(p: KVCachePool, group: int, rid: str) -> tuple[int, list[int | None]]:
    """The request's cached count in ``group`` and, per position, the block's id when it
    is live and hashed, 0 for null, None for live and not hashed."""
    m = p.managers[group]
    blocks = m.req_to_blocks[rid]
    ids = [0 if b.is_null else (b.block_id if b.block_hash is not None else None) for b in blocks]
    return m.num_cached_block[rid], ids


def rekey(p: KVCachePool, block_id: int, other: bytes, group: int) -> None:
    """Plant the defect the check exists for: the block stays where it is but its cache
    entry (map and block alike) names another key."""
    bp = p.block_pool
    block = bp.blocks[block_id]
    assert bp.evict_cached_block(block)
    bp.cached_block_hash_to_block.insert(other, group, block_id)
    block.cached_hash, block.cached_group = other, group


def test_a_first_allocation_with_external_tokens_beside_a_sparse_mamba_group_is_consistent() -> None:
    """The finding's state: 13 tokens, 1 external, 12 computed. The mamba group holds the
    external tokens' state block (2) at position 0 and the step's (6) at position 3; its
    cached count is 3 but none of its blocks is hashed (the replay boundary, 12, falls on
    position 2, a null), exactly as vLLM 0.33.0's manager; block 2 goes at the next step."""
    p = pool(7)
    tokens = list(range(13))
    p.add_request("a", tokens, hashes(tokens))
    assert p.allocate_slots("a", 12, 0, None, 0, 1) == ((3, 4, 5), (0, 0, 6))
    assert cached_at(p, 0, "a") == (3, [1, 3, 4, None])
    assert cached_at(p, 1, "a") == (3, [None, 0, 0, None])
    assert check_pool(p).violations == ()


def test_decode_filling_the_running_state_block_under_sparse_retention_is_consistent() -> None:
    """No external tokens: decode fills the block holding the running mamba state (5, at
    position 3), which the cached count passes and sparse retention does not hash."""
    p = pool(20)
    tokens = list(range(1, 14))
    p.add_request("a", tokens, hashes(tokens))
    assert p.allocate_slots("a", 13) == ((1, 2, 3, 4), (0, 0, 0, 5))
    for token in (100, 101, 102):
        p.new_step_starts()
        before = len(hashes(tokens))
        tokens.append(token)
        p.update_request(
            "a", num_computed_tokens=len(tokens) - 1, append_token_ids=[token],
            append_block_hashes=hashes(tokens)[before:],
        )  # fmt: skip
        assert p.allocate_slots("a", 1) == ((), ())
    assert cached_at(p, 1, "a") == (4, [0, 0, 0, None])
    assert check_pool(p).violations == ()


def test_a_sparse_sliding_window_groups_unkept_blocks_are_consistent() -> None:
    """A window of 5 tokens needs one block before each kept end: of 13 prompt tokens'
    three full blocks only position 2 (ending at the replay boundary 12) is hashed."""
    p = pool(20, SlidingWindowSpec(4, 5))
    tokens = list(range(1, 14))
    p.add_request("a", tokens, hashes(tokens))
    assert p.allocate_slots("a", 13) == ((1, 2, 3, 4), (5, 6, 7, 8))
    assert cached_at(p, 1, "a") == (3, [None, None, 7, None])
    assert check_pool(p).violations == ()


def test_a_cached_position_under_another_key_is_still_reported_under_sparse_retention() -> None:
    """The defect the check exists for, planted in a sparse pool: the mamba state hashed
    at the replay boundary (position 1 of a 12-token prompt's 8-token first chunk) re-keyed
    under the first block's key; and a full-attention block likewise."""
    p = pool(20)
    tokens = list(range(1, 13))
    h = hashes(tokens)
    p.add_request("a", tokens, h)
    assert p.allocate_slots("a", 8) == ((1, 2), (0, 3))
    assert cached_at(p, 1, "a") == (2, [0, 3])
    assert check_pool(p).violations == ()
    rekey(p, 3, h[0], 1)
    rekey(p, 2, h[0], 0)
    assert check_pool(p, evicted=False).violations == (
        "request 'a': block 2 at position 1 of group 0 is cached under another key than the request's",
        "request 'a': block 3 at position 1 of group 1 is cached under another key than the request's",
    )


def test_an_unhashed_cached_position_is_still_reported_where_retention_is_dense() -> None:
    """The relaxation is for sparse retention's groups only: with dense retention (None)
    the mamba state block at a cached position must be hashed, and in a sparse pool so
    must a full-attention block."""
    dense = pool(20, retention=None)
    tokens = list(range(1, 13))
    dense.add_request("a", tokens, hashes(tokens))
    assert dense.allocate_slots("a", 8) == ((1, 2), (0, 3))
    assert check_pool(dense).violations == ()
    assert dense.block_pool.evict_cached_block(dense.block_pool.blocks[3])
    assert check_pool(dense, evicted=False).violations == (
        "request 'a': block 3 at position 1 < num_cached 2 in group 1 is not cached",
    )
    sparse = pool(20)
    sparse.add_request("a", tokens, hashes(tokens))
    assert sparse.allocate_slots("a", 8) == ((1, 2), (0, 3))
    assert sparse.block_pool.evict_cached_block(sparse.block_pool.blocks[2])
    assert check_pool(sparse, evicted=False).violations == (
        "request 'a': block 2 at position 1 < num_cached 2 in group 0 is not cached",
    )


def test_a_dense_window_shorter_than_a_scheduler_block_leaves_blocks_unhashed_consistently() -> None:
    """Dense retention (None) keeps, per scheduler block, only the window tail a hit
    needs: full attention of 8-token blocks beside a window of 4 tokens in 4-token blocks
    (scheduler block 8) hashes every other window block, the one ending each scheduler
    block, as vLLM 0.33.0's manager does (tests/with_vllm/test_vs_vllm_connector.py
    compares the positions); the others are live and unhashed below the cached count, no
    violation. An evicted kept block is still one."""
    p = KVCachePool(
        KVCacheConfig(
            20, (FullAttentionSpec(8), SlidingWindowSpec(4, 4)), 4, max_model_len=64,
            profile="vllm-0.33", max_in_flight_tokens=1024, prefix_cache_retention_interval=None,
        )
    )  # fmt: skip
    tokens = list(range(1, 22))
    p.add_request("a", tokens, hashes(tokens))
    assert p.allocate_slots("a", 21) is not None
    count, ids = cached_at(p, 1, "a")
    assert count == 4 and [i is None for i in ids[:4]] == [True, False, True, False]
    assert check_pool(p).violations == ()
    kept = ids[1]
    assert kept is not None and p.block_pool.evict_cached_block(p.block_pool.blocks[kept])
    assert check_pool(p, evicted=False).violations == (
        f"request 'a': block {kept} at position 1 < num_cached 4 in group 1 is not cached",
    )
