"""The free-block queue: an intrusive doubly linked list with sentinel ends."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .blocks import KVCacheBlock
from .types import BlockId

__all__ = ["FreeKVCacheBlockQueue"]


class FreeKVCacheBlockQueue:
    """Blocks with no holder, in eviction order: head is reused first.

    Every operation is O(1) per block: removal from the middle uses the links stored
    in the blocks themselves, so touching a cached block never scans the queue.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(BlockId(-1))
        self._tail = KVCacheBlock(BlockId(-1))
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            IndexError: the queue is empty.
        """
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first.

        Raises:
            IndexError: fewer than ``n`` blocks are free (nothing is removed).
        """
        if n > self.num_free_blocks:
            raise IndexError(f"{n} blocks requested, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        cur = self._head.next_free
        for _ in range(n):
            assert cur is not None
            out.append(cur)
            nxt = cur.next_free
            cur.prev_free = cur.next_free = None
            cur = nxt
        assert cur is not None
        self._head.next_free = cur
        cur.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` at the tail, in the given order."""
        for block in blocks:
            self.append(block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        cur = self._head.next_free
        while cur is not None and cur is not self._tail:
            yield cur
            cur = cur.next_free

    def head_ids(self, limit: int | None = None) -> list[int]:
        """Block ids from the head, at most ``limit`` of them (all when ``None``)."""
        out: list[int] = []
        for block in self:
            if limit is not None and len(out) >= limit:
                break
            out.append(block.block_id)
        return out
