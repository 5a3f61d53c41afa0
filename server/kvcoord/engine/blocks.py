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
    ``ref_cnt == 0`` exactly when the block is in the free queue; ``block_hash`` is
    set exactly when the block is in the pool's hash map under that key. The
    ``prev_free`` / ``next_free`` links belong to :class:`FreeKVCacheBlockQueue` alone.
    """

    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHashWithGroupId | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"
