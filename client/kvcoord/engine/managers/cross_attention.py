"""Encoder-decoder cross-attention."""

from __future__ import annotations

from collections.abc import Sequence

from ..block_pool import BlockPool
from ..blocks import KVCacheBlock
from ..request import Request
from ..specs import AttentionSpec
from .base import SingleTypeKVCacheManager

__all__ = ["CrossAttentionManager"]


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Holds the encoder's KV: one static allocation of ``cdiv(encoder tokens, bs)``
    blocks at a request's first allocation; never cached, never shared.

    The coordinator hands this manager the encoder token count instead of the
    decoder's token count.
    """

    uses_null_blocks = False

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        # Cross-attention KV comes from the encoder, not from prefix tokens: nothing
        # to adopt
        assert not new_computed_blocks

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        clamp_below_a_block: bool = True,
    ) -> None:
        # external (decoder) tokens need no cross-attention blocks
        return

    def external_adoption_plan(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], local: int, external: int
    ) -> tuple[list[int], int]:
        return [], 0  # adopts no hit, takes no block for external tokens

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        raise AssertionError("cross-attention blocks are never cached")

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
        raise AssertionError("cross-attention has no prefix cache")
