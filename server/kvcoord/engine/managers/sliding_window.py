"""Sliding-window attention."""

from __future__ import annotations

from collections.abc import Sequence

from ..block_pool import BlockPool
from ..blocks import KVCacheBlock
from ..specs import AttentionSpec, SlidingWindowSpec
from .base import SingleTypeKVCacheManager, cdiv

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Only the last ``sliding_window`` tokens are attended; older blocks become null.

    A hit needs ``cdiv(w - 1, bs)`` contiguous cached blocks ending at the hit (one
    more with EAGLE), searched right to left; a shorter run touching position 0 is
    also a hit.
    """

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        assert isinstance(spec, SlidingWindowSpec)
        self.sliding_window = spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        spec: AttentionSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> list[list[KVCacheBlock]]:
        assert isinstance(spec, SlidingWindowSpec)
        bs = spec.block_size
        need = cdiv(spec.sliding_window - 1, bs) + (1 if use_eagle else 0)
        max_blocks = min(max_length // bs, len(block_hashes))
        null = block_pool.null_block
        computed = [[null] * max_blocks for _ in group_ids]
        run = 0
        found = False
        aligned = bs == alignment_tokens
        for i in range(max_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and not aligned and ((i + 1) * bs) % alignment_tokens:
                continue
            for lst, block in zip(computed, cached, strict=False):
                lst[i] = block
            run += 1
            if run >= need:
                for lst in computed:
                    del lst[i + run :]
                found = True
                break
        if not found:
            for lst in computed:
                del lst[run:]
            if not aligned:
                while (len(computed[0]) * bs) % alignment_tokens:
                    for lst in computed:
                        lst.pop()
        if use_eagle and computed[0]:
            for lst in computed:
                lst.pop()
        return computed
