"""A bounded, sequenced journal of one pool's KV events, for watchers and TakeEvents.

Events are engine values (the servicer converts them at the edge). Every reader has
its own cursor (a sequence number) and learns of a gap whenever events after its
cursor were dropped before it read them.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable

from kvcoord.engine import KVCacheEvent

__all__ = ["EventJournal"]


class EventJournal:
    """Events get sequence numbers 1, 2, ...; the newest ``capacity`` are kept.

    Readers (watch streams, each session's TakeEvents) read by sequence number and
    can resume after a disconnect, learning of a gap when what they missed is no
    longer kept.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._events: collections.deque[tuple[int, KVCacheEvent]] = collections.deque(maxlen=capacity)
        self.last_sequence = 0
        self._changed = asyncio.Event()
        self.closed = False
        #: the last sequence number that is durable (journal mode; None = every event
        #: is): watchers see nothing a crash could take back
        self.durable_sequence: int | None = None

    @property
    def visible_sequence(self) -> int:
        """The newest sequence number a watcher may see."""
        d = self.durable_sequence
        return self.last_sequence if d is None else min(d, self.last_sequence)

    def mark_durable(self, sequence: int) -> None:
        """Events up to ``sequence`` are committed: wake watchers waiting for them."""
        if self.durable_sequence is not None and sequence > self.durable_sequence:
            self.durable_sequence = sequence
            self._changed.set()
            self._changed = asyncio.Event()

    def publish(self, events: Iterable[KVCacheEvent]) -> int:
        """Append events; returns how many were added."""
        n = 0
        for event in events:
            self.last_sequence += 1
            self._events.append((self.last_sequence, event))
            n += 1
        if n:
            self._changed.set()
            self._changed = asyncio.Event()
        return n

    @property
    def oldest_sequence(self) -> int:
        return self._events[0][0] if self._events else self.last_sequence + 1

    def since(
        self, after: int, limit: int | None = None, upto: int | None = None
    ) -> list[tuple[int, KVCacheEvent]]:
        """Kept events with a sequence number above ``after`` (and at most ``upto``), oldest first."""
        last = self.last_sequence if upto is None else min(upto, self.last_sequence)
        if after >= last:
            return []
        start = max(after + 1, self.oldest_sequence) - self.oldest_sequence
        out = []
        for i in range(start, len(self._events) - (self.last_sequence - last)):
            out.append(self._events[i])
            if limit is not None and len(out) >= limit:
                break
        return out

    def missed(self, after: int) -> bool:
        """True when events after sequence ``after`` were dropped unread."""
        return after < self.last_sequence and after + 1 < self.oldest_sequence

    async def wait(self, after: int, timeout: float) -> None:
        """Return when an event above ``after`` exists, the journal closes, or after ``timeout``."""
        if self.visible_sequence > after or self.closed:
            return
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            pass

    def restore(self, events: list[tuple[int, KVCacheEvent]], last_sequence: int) -> None:
        """Load kept events and the sequence counter (recovery)."""
        self._events.clear()
        self._events.extend(events)
        self.last_sequence = last_sequence

    def resize(self, capacity: int) -> None:
        """Keep the newest ``capacity`` events from now on (a limit changed at restart)."""
        if capacity != self.capacity:
            self.capacity = capacity
            self._events = collections.deque(self._events, maxlen=capacity)

    def kept(self) -> list[tuple[int, KVCacheEvent]]:
        """The kept events, oldest first (snapshots)."""
        return list(self._events)

    def close(self) -> None:
        self.closed = True
        self._changed.set()
