"""Chunked local attention."""

from __future__ import annotations

from collections.abc import Sequence

from ..block_pool import BlockPool
from ..specs import AttentionSpec, ChunkedLocalAttentionSpec
from .base import SingleTypeKVCacheManager

__all__ = ["ChunkedLocalAttentionManager"]


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Attention within the current chunk only: earlier chunks are null blocks.

    Every position before the chunk holding ``max_length`` counts as a hit without any
    cached block; inside that chunk, cached blocks are matched left to right.
    """

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        self.chunk = spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk) * self.chunk

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
    ) -> list[list[int]]:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        bs = spec.block_size
        chunk = spec.attention_chunk_size
        start = (max_length // chunk) * chunk if max_length > 0 else 0
        start_block = start // bs
        computed: list[list[int]] = [[0] * start_block for _ in group_ids]
        for i in range(start_block, min(max_length // bs, len(block_hashes))):
            cached = block_pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                break
            for lst, block_id in zip(computed, cached, strict=False):
                lst.append(block_id)
        return computed
