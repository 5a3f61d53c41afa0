"""The free-block queue, with lazily created blocks."""

from __future__ import annotations

from collections.abc import Iterable

from .blocks import KVCacheBlock
from .types import BlockId

__all__ = ["FreeKVCacheBlockQueue"]


class FreeKVCacheBlockQueue:
    """Blocks with no holder, in eviction order: head is reused first.

    vLLM starts with every block in the queue in id order; pops take from the head and
    freed blocks go to the tail. So the queue is always a run of never-used ids,
    ascending, followed by blocks that were used and freed. The run is kept as a
    counter (``[next_fresh, num_blocks)``) and its blocks are created only when popped,
    in id order.

    The used part is a Python list read from index ``head``, with lazy deletion: entry
    ``i`` is live exactly when its block's ``free_pos == i``. Appending sets
    ``free_pos``; taking a block out of the middle (a prefix hit on a free block) sets
    it to -1 and leaves a dead entry behind. Appends are plain ``list.append`` calls,
    cheaper than any linked structure in pure Python, and the list is compacted (dead
    entries dropped, positions renumbered) once dead entries outnumber live ones, so
    every operation is amortised O(1) per block.

    Invariant: a block is in the queue exactly when its ``ref_cnt`` is 0 (callers keep
    counts; the null block is never in the queue).

    Args:
        num_blocks: ids ``0 .. num_blocks-1`` start in the queue.
        blocks: the pool's block table, indexed by id; blocks are appended to it as
            they are created. Blocks already in it start in the used part, in order.
    """

    __slots__ = ("_blocks", "_head", "_live", "_next_fresh", "_num_blocks", "_queue")

    def __init__(self, num_blocks: int, blocks: list[KVCacheBlock]) -> None:
        self._blocks = blocks
        self._num_blocks = num_blocks
        self._next_fresh = len(blocks)
        self._queue = list(blocks)
        for i, block in enumerate(self._queue):
            block.free_pos = i
        self._head = 0
        self._live = len(self._queue)

    @property
    def num_free_blocks(self) -> int:
        return self._num_blocks - self._next_fresh + self._live

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
        if n > num_fresh + self._live:
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
        left = n - num_fresh
        self._live -= left
        queue = self._queue
        i = self._head
        append = out.append
        while left:
            block = queue[i]
            if block.free_pos == i:
                block.free_pos = -1
                append(block)
                left -= 1
            i += 1
        self._head = i
        if i > 4096 and i > len(queue) >> 1:
            self._compact()
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the queue, wherever it is.

        Raises:
            ValueError: the block is not in the queue.
        """
        if block.free_pos < 0:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.free_pos = -1
        self._live -= 1
        self._maybe_compact()

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` (a created block, not in the queue) at the tail."""
        block.free_pos = len(self._queue)
        self._queue.append(block)
        self._live += 1

    def release(self, blocks: Iterable[KVCacheBlock], null: KVCacheBlock | None) -> int:
        """Drop one reference on each block (``null`` skipped; pass ``None`` when the
        blocks cannot contain it); those reaching zero are appended, in order. Returns
        how many were appended."""
        queue = self._queue
        start = pos = len(queue)
        append = queue.append
        if null is None:
            for block in blocks:
                ref = block.ref_cnt - 1
                block.ref_cnt = ref
                if not ref:
                    block.free_pos = pos
                    pos += 1
                    append(block)
        else:
            for block in blocks:
                if block is null:
                    continue
                ref = block.ref_cnt - 1
                block.ref_cnt = ref
                if not ref:
                    block.free_pos = pos
                    pos += 1
                    append(block)
        self._live += pos - start
        return pos - start

    def acquire(self, blocks: Iterable[KVCacheBlock], null: KVCacheBlock) -> None:
        """Take one reference on each block (``null`` skipped), pulling free ones out of
        the queue."""
        removed = 0
        for block in blocks:
            if block is null:
                continue
            if not block.ref_cnt:
                block.free_pos = -1
                removed += 1
            block.ref_cnt += 1
        if removed:
            self._live -= removed
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        if len(self._queue) - self._head > 2 * self._live + 4096:
            self._compact()

    def _compact(self) -> None:
        queue = self._queue
        live = [block for i, block in enumerate(queue) if i >= self._head and block.free_pos == i]
        for i, block in enumerate(live):
            block.free_pos = i
        self._queue = live
        self._head = 0

    def head_ids(self, limit: int | None = None) -> list[int]:
        """Block ids from the head, at most ``limit`` of them (all when ``None``)."""
        fresh, end = self._next_fresh, self._num_blocks
        if limit is None:
            limit = end - fresh + self._live
        limit = max(limit, 0)
        if limit <= end - fresh:
            return list(range(fresh, fresh + limit))
        out = list(range(fresh, end))
        left = limit - len(out)
        queue = self._queue
        for i in range(self._head, len(queue)):
            if not left:
                break
            block = queue[i]
            if block.free_pos == i:
                out.append(block.block_id)
                left -= 1
        return out
