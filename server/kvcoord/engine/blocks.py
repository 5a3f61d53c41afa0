"""Per-block state."""

from __future__ import annotations

from .types import BlockHashWithGroupId, BlockId

__all__ = ["KVCacheBlock"]


class KVCacheBlock:
    """One physical KV block.

    Invariants (outside the null block, whose ``ref_cnt`` is not meaningful):
    ``ref_cnt`` is the number of live (request, group) block lists holding the block;
    ``ref_cnt == 0`` exactly when the block is in the free queue; ``cached_hash`` is
    set exactly when the block is in the pool's hash map under that hash for group
    ``cached_group``.

    Blocks hold no links to other blocks (the free queue keeps its own order), so a
    pool's blocks form no reference cycles and are reclaimed by reference counting
    alone when the pool is dropped.
    """

    __slots__ = ("block_id", "ref_cnt", "cached_hash", "cached_group", "is_null", "free_pos", "event_hash")

    def __init__(self, block_id: BlockId) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        #: the block hash (at the group's granularity) this block is cached under
        self.cached_hash: bytes | None = None
        self.cached_group = 0
        self.is_null = False
        #: index of the block's live entry in the free queue's list, -1 when not in it;
        #: owned by :class:`~kvcoord.engine.free_queue.FreeKVCacheBlockQueue`
        self.free_pos = -1
        #: the client's hash when ``cached_hash`` is a namespaced key (what KV events
        #: report); ``None`` otherwise
        self.event_hash: bytes | None = None

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The cache key ``hash ‖ uint32_be(group)``, or ``None`` when not cached."""
        h = self.cached_hash
        if h is None:
            return None
        return BlockHashWithGroupId(h + self.cached_group.to_bytes(4, "big"))

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"
