"""Per-block state."""

from __future__ import annotations

import dataclasses

from .types import BlockHashWithGroupId, BlockId

__all__ = ["KVCacheBlock"]


@dataclasses.dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical KV block.

    Invariants (outside the null block, whose ``ref_cnt`` is not meaningful):
    ``ref_cnt`` is the number of live (request, group) block lists holding the block;
    ``ref_cnt == 0`` exactly when the block is in the free queue; ``cached_hash`` is set
    exactly when the block is in the pool's hash map under that hash (at the group's
    granularity) for group ``cached_group``. ``stale_entries`` belongs to
    :class:`~kvcoord.engine.free_queue.FreeKVCacheBlockQueue` alone: how many dead
    entries of this block its list still holds.

    Blocks hold no references to other blocks, so a pool's blocks form no reference
    cycles and are reclaimed by reference counting alone when the pool is dropped.
    """

    block_id: BlockId
    ref_cnt: int = 0
    cached_hash: bytes | None = None
    cached_group: int = 0
    is_null: bool = False
    stale_entries: int = 0
    #: the client's hash when ``cached_hash`` is a namespaced key (what KV events
    #: report); ``None`` otherwise
    event_hash: bytes | None = None

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The cache key ``hash ‖ uint32_be(group)``, or ``None`` when not cached."""
        h = self.cached_hash
        if h is None:
            return None
        return BlockHashWithGroupId(h + self.cached_group.to_bytes(4, "big"))

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"
