"""KV cache events, as vLLM's block pool queues them."""

from __future__ import annotations

import dataclasses

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent", "hash_to_int64"]

MEDIUM_GPU = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of newly full blocks of one group became cache hits.

    ``block_hashes`` and ``parent_block_hash`` are raw hash bytes at the group's
    granularity (merged hashes for groups with larger blocks), without group id.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    medium: str = MEDIUM_GPU


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks lost their hash (reused from the free queue, or evicted)."""

    block_hashes: tuple[bytes, ...]
    medium: str = MEDIUM_GPU


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """A successful prefix-cache reset forgot every cached hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def hash_to_int64(block_hash: bytes) -> int:
    """vLLM's integer form of a hash in events: the last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")
