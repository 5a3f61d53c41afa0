"""The free-block queue, with lazily created blocks."""

from __future__ import annotations

from collections import OrderedDict

from .blocks import KVCacheBlock
from .types import BlockId

__all__ = ["FreeKVCacheBlockQueue"]


class FreeKVCacheBlockQueue:
    """Blocks with no holder, in eviction order: head is reused first.

    vLLM starts with every block in the queue in id order; pops take from the head and
    freed blocks go to the tail. So the queue is always a run of never-used ids,
    ascending, followed by blocks that were used and freed. The run is kept as a
    counter (``[next_fresh, num_blocks)``) and its blocks are created only when popped,
    in id order; the used part is an ``OrderedDict`` keyed by block id, whose C-level
    links give O(1) append, pop from the head and removal from the middle.

    Args:
        num_blocks: ids ``0 .. num_blocks-1`` start in the queue.
        blocks: the pool's block table, indexed by id; blocks are appended to it as
            they are created. Blocks already in it start in the used part, in order.
    """

    __slots__ = ("_blocks", "_next_fresh", "_num_blocks", "used")

    def __init__(self, num_blocks: int, blocks: list[KVCacheBlock]) -> None:
        self._blocks = blocks
        self._num_blocks = num_blocks
        self._next_fresh = len(blocks)
        #: the used part, head first; the block pool appends to and removes from it
        #: directly in its per-block loops (``used[id] = block``, ``del used[id]``).
        self.used: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    @property
    def num_free_blocks(self) -> int:
        return self._num_blocks - self._next_fresh + len(self.used)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            IndexError: the queue is empty.
        """
        if not self.num_free_blocks:
            raise IndexError("no free blocks")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first.

        Raises:
            IndexError: fewer than ``n`` blocks are free (nothing is removed).
        """
        fresh = self._next_fresh
        num_fresh = self._num_blocks - fresh
        if n > num_fresh + len(self.used):
            raise IndexError(f"{n} blocks requested, {self.num_free_blocks} free")
        if n <= num_fresh:
            out = [KVCacheBlock(BlockId(i)) for i in range(fresh, fresh + n)]
            self._blocks.extend(out)
            self._next_fresh = fresh + n
            return out
        out = []
        if num_fresh:
            out = [KVCacheBlock(BlockId(i)) for i in range(fresh, self._num_blocks)]
            self._blocks.extend(out)
            self._next_fresh = self._num_blocks
        pop = self.used.popitem
        for _ in range(n - num_fresh):
            out.append(pop(False)[1])
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the queue, wherever it is.

        Raises:
            ValueError: the block is not in the queue.
        """
        if self.used.pop(block.block_id, None) is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` (a created block, not in the queue) at the tail."""
        self.used[block.block_id] = block

    def head_ids(self, limit: int | None = None) -> list[int]:
        """Block ids from the head, at most ``limit`` of them (all when ``None``)."""
        fresh, end = self._next_fresh, self._num_blocks
        if limit is None:
            return list(range(fresh, end)) + list(self.used)
        if limit <= end - fresh:
            return list(range(fresh, fresh + max(limit, 0)))
        out = list(range(fresh, end))
        left = limit - len(out)
        if left >= len(self.used):
            out.extend(self.used)
            return out
        for bid in self.used:
            if not left:
                break
            out.append(bid)
            left -= 1
        return out
