"""The values a pool hands back: prefix hits, allocation outcomes, checkpoints, snapshots.

All are frozen, slotted dataclasses: they cross the engine's boundary (the service
converts them to messages), so nobody may change one after the pool made it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .events import KVCacheEvent
from .stats import PrefixCacheStats

__all__ = ["AllocationResult", "BlockIds", "CacheHit", "PoolSnapshot", "RequestCheckpoint", "new_hit"]

#: One tuple of block ids per KV cache group, in group order.
BlockIds = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class CacheHit:
    """A prefix-cache hit: one block-id list per group (0 = null block) and its length.

    A hit is a hint: it is valid until the pool's next mutation.
    """

    block_ids: BlockIds
    num_tokens: int

    @property
    def is_empty(self) -> bool:
        """True when every group's list is empty (null blocks count as entries)."""
        return not any(self.block_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class AllocationResult:
    """The outcome of :meth:`KVCachePool.allocate_slots_with_lookup`.

    ``new_block_ids`` is ``None`` when the pool had too few free blocks; then only
    skipped-block removal (and the lookup's statistics) changed the pool.
    """

    hit: CacheHit
    num_new_tokens: int
    new_block_ids: BlockIds | None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestCheckpoint:
    """A request's sizes before an update, to undo it (see ``restore_request``)."""

    num_tokens: int
    num_block_hashes: int
    num_computed_tokens: int
    #: the prompt's length then (``None``: unchanged by the updates to undo, which do
    #: not set one: ``update_request``'s ``num_prompt_tokens``)
    num_prompt_tokens: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRewind:
    """What a rewind (``rewind_request``) dropped of a request, to undo it
    (``unrewind_request``): the sizes it kept and the tokens and hashes past them."""

    num_tokens: int
    num_block_hashes: int
    dropped_token_ids: tuple[int, ...]
    dropped_block_hashes: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Everything observable about a pool, for equality checks in tests and tools."""

    free_queue: tuple[int, ...]
    ref_cnts: tuple[int, ...]
    block_hashes: tuple[bytes | None, ...]
    hash_map: tuple[tuple[bytes, tuple[int, ...]], ...]
    requests: tuple[tuple[object, ...], ...]
    managers: tuple[tuple[object, ...], ...]
    pending_events: tuple[KVCacheEvent, ...]
    stats: PrefixCacheStats | None


_set_hit_block_ids: Callable[[CacheHit, BlockIds], None] = vars(CacheHit)["block_ids"].__set__
_set_hit_num_tokens: Callable[[CacheHit, int], None] = vars(CacheHit)["num_tokens"].__set__


def new_hit(block_ids: BlockIds, num_tokens: int) -> CacheHit:
    """``CacheHit(block_ids, num_tokens)`` without the frozen dataclass's ``__init__``
    (one per lookup): the slots are written through their member descriptors, which is
    what the generated ``__init__`` does, at a fraction of the cost."""
    hit: CacheHit = object.__new__(CacheHit)
    _set_hit_block_ids(hit, block_ids)
    _set_hit_num_tokens(hit, num_tokens)
    return hit
