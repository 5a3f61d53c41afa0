"""The invariants of semantics.md §7, checked on a live engine pool."""

from __future__ import annotations

from kvcoord.engine import FullAttentionSpec, KVCachePool
from kvcoord.engine.invariants import check_pool


def check_invariants(pool: KVCachePool, evicted: bool = False) -> None:
    """Raise AssertionError naming the broken invariants (the engine's own check,
    :func:`kvcoord.engine.invariants.check_pool`, which CheckPool exposes).

    Args:
        pool: the pool to check.
        evicted: ``evict_blocks`` was used, which may leave shared or cached-position
            blocks without their hash (invariants 5 and 6 are then weaker).
    """
    result = check_pool(pool, evicted or pool.evict_blocks_called)
    assert result.ok, "; ".join(result.violations[:5])


def check_hit(pool: KVCachePool, num_tokens: int, block_ids: tuple[tuple[int, ...], ...], hit: int) -> None:
    """Invariant 7: hits are short of the prompt, aligned, and sized per group."""
    coordinator = pool.coordinator
    if not pool.enable_caching:
        assert hit == 0 and not any(block_ids)
        return
    assert hit <= max(num_tokens - 1, 0)
    assert hit % coordinator.alignment_tokens == 0
    first_full = None
    groups = getattr(coordinator, "attention_groups", None)
    if groups and isinstance(groups[0][0], FullAttentionSpec):
        first_full = set(groups[0][1])
    for gid, ids in enumerate(block_ids):
        bs = pool.config.groups[gid].block_size
        if (
            isinstance(pool.config.groups[gid], FullAttentionSpec)
            and first_full is not None
            and gid not in first_full
        ):
            assert len(ids) * bs >= hit
        else:
            assert len(ids) * bs == hit, f"group {gid}: {len(ids)} blocks for a {hit}-token hit"
