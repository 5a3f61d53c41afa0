"""The free-block queue, with lazily created blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .blocks import KVCacheBlock

__all__ = ["FreeKVCacheBlockQueue"]


class FreeKVCacheBlockQueue:
    """Blocks with no holder, in eviction order: head is reused first.

    vLLM starts with every block in the queue in id order; pops take from the head and
    freed blocks go to the tail. So the queue is always a run of never-used ids,
    ascending, followed by blocks that were used and freed. The run is kept as a
    counter (``[next_fresh, num_blocks)``) and its blocks are created only when popped,
    in id order.

    The used part is a Python list read from index ``head``, with lazy deletion.
    Appending is a plain ``list.append`` (cheaper than any linked structure in pure
    Python). Taking a block out of the middle (a prefix hit on a free block) leaves its
    entry in place and counts it in the block's ``stale_entries``: a block's entries
    lie in the list in the order they were added and it has at most one live entry
    (its newest), so when a scan from the head meets an entry of a block whose
    ``stale_entries`` is positive, that entry is a dead one: it is skipped and the count
    goes down. The list is compacted once dead entries outnumber live ones, so every
    operation is amortised O(1) per block.

    Invariant: a block is in the queue exactly when its ``ref_cnt`` is 0 (callers keep
    the counts; the null block is never in the queue).

    Args:
        num_blocks: ids ``0 .. num_blocks-1`` start in the queue.
        blocks: the pool's block table, indexed by id; blocks are appended to it as
            they are created. Blocks already in it start in the used part, in order.
    """

    __slots__ = (
        "_blocks",
        "_dead",
        "_front",
        "_head",
        "_live",
        "_compactions",
        "_next_fresh",
        "_num_blocks",
        "_positions",
        "_queue",
        "compact_slack",
    )

    def __init__(self, num_blocks: int, blocks: list[KVCacheBlock]) -> None:
        self._blocks = blocks
        self._num_blocks = num_blocks
        self._next_fresh = len(blocks)
        self._queue = list(blocks)
        self._head = 0
        self._live = len(self._queue)
        self._dead = 0  # dead entries at or after head
        #: blocks put ahead of everything else (prepend_n), the head block last; only
        #: the vllm-0.33 profile prepends. Its blocks hold no hash, so no lookup ever
        #: takes one out of the middle: they leave from the head only.
        self._front: list[KVCacheBlock] = []
        #: compactions so far, and the positions first_position read (with the queue
        #: state they belong to)
        self._compactions = 0
        self._positions: tuple[tuple[int, ...], dict[int, int], int] | None = None
        #: dead or consumed entries tolerated beyond the live ones before compacting
        #: (tests lower it to compact often)
        self.compact_slack = 4096

    @property
    def num_free_blocks(self) -> int:
        return self._num_blocks - self._next_fresh + self._live + len(self._front)

    def __len__(self) -> int:
        return self.num_free_blocks

    @property
    def next_fresh(self) -> int:
        """The first never-used block id (``num_blocks`` once every block was used)."""
        return self._next_fresh

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
        front = self._front
        if front:
            return self._popleft_front(n)
        fresh = self._next_fresh
        num_fresh = self._num_blocks - fresh
        if n > num_fresh + self._live:
            raise IndexError(f"{n} blocks requested, {self.num_free_blocks} free")
        # (blocks made as first taken: their ids are ``i`` itself, where ``BlockId(i)``
        # is a Python call per block, half of a fresh block's cost)
        if n <= num_fresh:
            return self._make_fresh(fresh + n)
        out = self._make_fresh(self._num_blocks) if num_fresh else []
        left = n - num_fresh
        self._live -= left
        queue = self._queue
        i = self._head
        if not self._dead:  # no dead entry ahead: the next ``left`` entries are live
            out += queue[i : i + left]
            i += left
        else:
            append = out.append
            skipped = 0
            while left:
                block = queue[i]
                i += 1
                if block.stale_entries:
                    block.stale_entries -= 1
                    skipped += 1
                else:
                    append(block)
                    left -= 1
            self._dead -= skipped
        self._head = i
        if i > self.compact_slack and i > len(queue) >> 1:
            self._compact()
        return out

    def _popleft_front(self, n: int) -> list[KVCacheBlock]:
        """``popleft_n`` while prepended blocks wait at the head: they go first."""
        front = self._front
        if n > self.num_free_blocks:
            raise IndexError(f"{n} blocks requested, {self.num_free_blocks} free")
        k = min(n, len(front))
        out = front[-k:]
        out.reverse()
        del front[-k:]
        if n > k:
            out += self.popleft_n(n - k)
        return out

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` (created, not in the queue) at the head, in their order: the
        first of them is the next block handed out."""
        self._front.extend(reversed(blocks))

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` (which must be in the queue) out of it, wherever it is.

        Raises:
            ValueError: the block is held (``ref_cnt > 0``), so it is not in the queue.
        """
        if block.ref_cnt:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.stale_entries += 1
        self._live -= 1
        self._dead += 1
        self._maybe_compact()

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` (a created block, not in the queue) at the tail."""
        self._queue.append(block)
        self._live += 1

    def release(self, blocks: Iterable[KVCacheBlock], null: KVCacheBlock | None) -> int:
        """Drop one reference on each block (``null`` skipped; pass ``None`` when the
        blocks cannot contain it); those reaching zero are appended, in order. Returns
        how many were appended."""
        queue = self._queue
        start = len(queue)
        append = queue.append
        if null is None:
            for block in blocks:
                ref = block.ref_cnt - 1
                block.ref_cnt = ref
                if not ref:
                    append(block)
        else:
            for block in blocks:
                if block is null:
                    continue
                ref = block.ref_cnt - 1
                block.ref_cnt = ref
                if not ref:
                    append(block)
        n = len(queue) - start
        self._live += n
        return n

    def release_split(self, blocks: Iterable[KVCacheBlock], null: KVCacheBlock | None, caching: bool) -> int:
        """:meth:`release` by vLLM 0.33's rule: of the blocks reaching zero, those
        holding a hash (caching on) go to the tail, the others to the head, each part in
        the order given (the first of the prepended ones is the next handed out).
        Returns how many were released."""
        queue = self._queue
        start = len(queue)
        append = queue.append
        first: list[KVCacheBlock] = []
        for block in blocks:
            if block is null:
                continue
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            if not ref:
                if caching and block.cached_hash is not None:
                    append(block)
                else:
                    first.append(block)
        n = len(queue) - start
        self._live += n
        if first:
            self._front.extend(reversed(first))
        return n + len(first)

    def acquire(self, blocks: Iterable[KVCacheBlock], null: KVCacheBlock) -> None:
        """Take one reference on each block (``null`` skipped), pulling free ones out of
        the queue."""
        removed = 0
        for block in blocks:
            if block is null:
                continue
            if not block.ref_cnt:
                if self._front and block in self._front:  # never: prepended blocks hold no hash
                    self._front.remove(block)
                    block.ref_cnt += 1
                    continue
                block.stale_entries += 1
                removed += 1
            block.ref_cnt += 1
        if removed:
            self._live -= removed
            self._dead += removed
            self._maybe_compact()

    def load(self, next_fresh: int, used: list[KVCacheBlock], front: Sequence[KVCacheBlock] = ()) -> None:
        """Set the queue to ``front``, then the never-used run ``[next_fresh, num_blocks)``,
        then ``used`` (created blocks whose ``ref_cnt`` is 0, head first): state import."""
        self._front = list(reversed(front))
        self._next_fresh = next_fresh
        self._queue = list(used)
        self._head = self._dead = 0
        self._live = len(self._queue)
        self._compactions += 1
        self._positions = None
        for block in used:
            block.stale_entries = 0
        for block in front:
            block.stale_entries = 0

    def materialize(self) -> int:
        """Create the never-used run's blocks now, in their place (after the prepended
        blocks, ahead of the used part), as vLLM creates every block when its pool is
        built; returns how many were made. Nothing else changes: the same blocks leave
        the queue in the same order. For a host whose heap is frozen once it is built
        (vLLM's engine core, ``gc.freeze``): blocks made later, as first taken, would
        stay in the cyclic collector's view, and every full collection would walk them."""
        if self._next_fresh >= self._num_blocks:
            return 0
        made = self._make_fresh(self._num_blocks)
        self._queue = made + self._queue[self._head :]
        self._head = 0
        self._live += len(made)
        self._compactions += 1
        self._positions = None
        return len(made)

    def _make_fresh(self, end: int) -> list[KVCacheBlock]:
        """The never-used run's blocks up to id ``end`` (excluded), made now and known
        to the pool from here on."""
        made = [KVCacheBlock(i) for i in range(self._next_fresh, end)]  # type: ignore[arg-type]
        self._blocks.extend(made)
        self._next_fresh = end
        return made

    def front_ids(self) -> list[int]:
        """The prepended blocks' ids, head first (they come before the never-used run)."""
        return [b.block_id for b in reversed(self._front)]

    def drain(self, chunk: int) -> Iterator[None]:
        """Empty the queue ``chunk`` entries at a time, yielding after each (teardown)."""
        self._front.clear()
        q = self._queue
        while q:
            del q[-chunk:]
            yield
        self._head = self._live = self._dead = 0
        self._next_fresh = self._num_blocks
        self._compactions += 1

    def _maybe_compact(self) -> None:
        if self._dead > self._live + self.compact_slack:
            self._compact()

    def _compact(self) -> None:
        live: list[KVCacheBlock] = []
        append = live.append
        queue = self._queue
        for i in range(self._head, len(queue)):
            block = queue[i]
            if block.stale_entries:
                block.stale_entries -= 1
            else:
                append(block)
        self._queue = live
        self._head = 0
        self._dead = 0
        self._compactions += 1

    def first_position(self, block_ids: set[int], limit: int) -> int:
        """How many free blocks are ahead of the first of ``block_ids`` in the queue
        (blocks that must leave the queue before it can be reused), or a lower bound on
        that: at most ``limit``, and the free blocks counted when ``limit`` entries (dead
        ones included) were read without meeting one of them.

        The positions of the first ``limit`` entries are read once and kept until the
        queue changes, so the lookups of one Step (which change nothing) share one walk:
        O(limit) for the first call, O(len(block_ids)) for the next ones.
        """
        if not block_ids:
            return limit
        # prepended and never-used blocks hold no hash
        fresh = len(self._front) + self._num_blocks - self._next_fresh
        if fresh >= limit:
            return limit
        queue = self._queue
        key = (self._compactions, self._head, len(queue), self._live, self._dead, fresh, limit)
        cached = self._positions
        if cached is None or cached[0] != key:
            positions: dict[int, int] = {}
            pending: dict[int, int] = {}  # dead entries met so far, per block (not consumed)
            pos = fresh
            end = limit
            for i in range(self._head, min(len(queue), self._head + limit)):
                block = queue[i]
                bid = block.block_id
                if block.stale_entries:
                    seen = pending.get(bid, 0)
                    if seen < block.stale_entries:
                        pending[bid] = seen + 1
                        continue
                positions[bid] = pos
                pos += 1
                if pos >= limit:
                    break
            else:
                if self._head + limit < len(queue):
                    end = pos  # read ``limit`` entries: everything else is further back
            cached = self._positions = (key, positions, end)
        _, positions, end = cached
        found = [positions[b] for b in block_ids if b in positions]
        return min(found) if found else end

    def head_ids(self, limit: int | None = None) -> list[int]:
        """Block ids from the head, at most ``limit`` of them (all when ``None``)."""
        if not self._front:
            return self._back_ids(limit)
        front = self.front_ids()
        if limit is not None and limit <= len(front):
            return front[: max(limit, 0)]
        return front + self._back_ids(None if limit is None else limit - len(front))

    def _back_ids(self, limit: int | None) -> list[int]:
        """:meth:`head_ids` of the never-used run and the used part."""
        fresh, end = self._next_fresh, self._num_blocks
        if limit is None:
            limit = end - fresh + self._live
        limit = max(limit, 0)
        if limit <= end - fresh:
            return list(range(fresh, fresh + limit))
        out = list(range(fresh, end))
        left = limit - len(out)
        queue = self._queue
        pending: dict[int, int] = {}  # dead entries met so far, per block (not consumed)
        for i in range(self._head, len(queue)):
            if not left:
                break
            block = queue[i]
            seen = pending.get(block.block_id, 0)
            if seen < block.stale_entries:
                pending[block.block_id] = seen + 1
            else:
                out.append(block.block_id)
                left -= 1
        return out
