"""What a subscriber of a ``[[kv_events]]`` publisher holds, kept on the publisher's
side (kv_publisher.py): the blocks stored since a gap's clear, which decide which
removals such a subscriber can apply, and the blocks a subscriber that applied every
batch holds, which a replay that cannot be answered whole sends instead."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["PublishedBlocks", "StoredSinceGap"]


class StoredSinceGap:
    """After a gap's clear, the blocks stored since, counted per (group, hash).

    The events kept after a gap still hold ``BlockRemoved`` of blocks stored before
    its clear, which the subscribers dropped with it: a stream no vLLM engine sends
    (docs/routing.md's count index would raise KeyError; a Counter would go negative
    and later hide a cached block). :meth:`keep` leaves those removals out, until a
    clear of the pool's own (a reset: nothing stored before it is cached) makes the
    stream whole again. A removal of a hash stored both before and after the clear
    cannot tell which block left: it is sent while the count since the clear lasts,
    so an index may miss a cached block, never keep one the pool dropped. The counts
    are bounded by the blocks cached (a count goes with its hash's last removal)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int | None, bytes]] | None = None

    def start(self) -> None:
        self.counts = Counter()

    def stop(self) -> None:
        self.counts = None

    def keep(self, events: list[KVCacheEvent]) -> list[KVCacheEvent]:
        """``events`` without the removals of blocks stored before the gap's clear."""
        if self.counts is None:
            return events
        out: list[KVCacheEvent] = []
        for e in events:
            counts = self.counts
            if counts is None or isinstance(e, AllBlocksCleared):
                self.counts = None
            elif isinstance(e, BlockStored):
                counts.update((e.group_idx, h) for h in e.block_hashes)
            elif isinstance(e, BlockRemoved):
                seen = []
                for h in e.block_hashes:
                    key = (e.group_idx, h)
                    if counts[key] > 0:
                        seen.append(h)
                        counts[key] -= 1
                        if not counts[key]:
                            del counts[key]
                if len(seen) < len(e.block_hashes):
                    if not seen:
                        continue
                    e = dataclasses.replace(e, block_hashes=tuple(seen))
            out.append(e)
        return out


class PublishedBlocks:
    """The blocks a subscriber that applied every batch sent holds: each ``BlockStored``
    sent, with which of its blocks no ``BlockRemoved`` sent since took away (a removal
    takes one block of its (group, hash), the oldest stored; a removal of a block never
    stored here is ignored). Bounded by the blocks the pool caches."""

    def __init__(self) -> None:
        #: event number -> [the event, which of its blocks are held, how many]
        self._stored: dict[int, list[object]] = {}
        #: (group, hash) -> the held blocks of that key, as (event number, position)
        self._where: dict[tuple[int | None, bytes], list[tuple[int, int]]] = {}
        self._numbers = itertools.count()

    def apply(self, events: list[KVCacheEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                n = next(self._numbers)
                self._stored[n] = [e, [True] * len(e.block_hashes), len(e.block_hashes)]
                for i, h in enumerate(e.block_hashes):
                    self._where.setdefault((e.group_idx, h), []).append((n, i))
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    held = self._where.get((e.group_idx, h))
                    if not held:
                        continue
                    n, i = held.pop(0)
                    if not held:
                        del self._where[(e.group_idx, h)]
                    entry = self._stored[n]
                    entry[1][i] = False  # type: ignore[index]
                    entry[2] = left = entry[2] - 1  # type: ignore[operator]
                    if not left:
                        del self._stored[n]
            else:
                self._stored.clear()
                self._where.clear()

    def snapshot(self) -> list[KVCacheEvent]:
        """``AllBlocksCleared``, then the held blocks as ``BlockStored``: applied, any
        index holds what applying every batch sent would (each event's held blocks, in
        runs; a run shorter than its event has its blocks' tokens and per-block fields
        when they are one per block, else the event's own)."""
        out: list[KVCacheEvent] = [AllBlocksCleared()]
        for e, held, _ in self._stored.values():
            assert isinstance(e, BlockStored) and isinstance(held, list)
            if all(held):
                out.append(e)
                continue
            for _, run in itertools.groupby(range(len(held)), key=held.__getitem__):
                positions = list(run)
                if held[positions[0]]:
                    out.append(_part(e, positions[0], positions[-1] + 1))
        return out


def _part(e: BlockStored, start: int, end: int) -> BlockStored:
    """Blocks ``start:end`` of a stored run, as the event storing them alone would be."""
    n = len(e.block_hashes)
    tokens = e.token_ids
    if len(tokens) == n * e.block_size:  # one block of tokens per hash
        tokens = tokens[start * e.block_size : end * e.block_size]

    extra, lookahead = e.extra_keys, e.lookahead_token_ids
    if extra is not None and len(extra) == n:
        extra = extra[start:end]
    if lookahead is not None and len(lookahead) == n:
        lookahead = lookahead[start:end]
    return dataclasses.replace(
        e,
        block_hashes=e.block_hashes[start:end],
        parent_block_hash=e.parent_block_hash if start == 0 else e.block_hashes[start - 1],
        token_ids=tokens,
        extra_keys=extra,
        lookahead_token_ids=lookahead,
    )
