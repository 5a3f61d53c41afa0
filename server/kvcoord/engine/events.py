"""KV cache events, as vLLM's block pool queues them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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

_new = object.__new__
_set_removed_hashes: Callable[[BlockRemoved, tuple[bytes, ...]], None] = vars(BlockRemoved)[
    "block_hashes"
].__set__
_set_removed_medium: Callable[[BlockRemoved, str], None] = vars(BlockRemoved)["medium"].__set__


def block_removed(block_hash: bytes) -> BlockRemoved:
    """``BlockRemoved(block_hashes=(block_hash,))``, built without the frozen dataclass's
    ``__init__`` (one per evicted block; the generated one costs several times more).

    The slots are written through their member descriptors, exactly what the generated
    ``__init__`` ends up doing, so the result is equal to the normally built event.
    """
    event: BlockRemoved = _new(BlockRemoved)
    _set_removed_hashes(event, (block_hash,))
    _set_removed_medium(event, MEDIUM_GPU)
    return event


def hash_to_int64(block_hash: bytes) -> int:
    """vLLM's integer form of a hash in events: the last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")
