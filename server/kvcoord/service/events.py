"""A bounded, sequenced journal of one pool's KV events, for watchers and TakeEvents.

Events are engine values (the servicer converts them at the edge). Every reader has
its own cursor (a sequence number) and learns of a gap whenever events after its
cursor were dropped before it read them.

The journal is bounded twice: by a number of events (``[limits] event_buffer``) and by
an estimate of the bytes they hold (:func:`event_memory_bytes`; a pool's bound is part
of its memory estimate, budget.py), whichever is reached first drops the oldest.

What a watcher may read is the *visible* prefix: with a journal, only events whose
records are committed (:meth:`EventJournal.mark_durable`). A commit may lag behind a
burst of events large enough to push the oldest kept event past it; a reader then has
nothing deliverable until the commit catches up, and :meth:`EventJournal.wait`
suspends until it does (it never returns early while nothing can be read: a stream
loop built on it cannot spin).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Iterable
from itertools import accumulate
from typing import cast

from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcoord.engine.events import MEDIUM_GPU, block_removed, block_stored

__all__ = [
    "EVENT_BYTES",
    "EVENT_HASH_BYTES",
    "EVENT_TOKEN_BYTES",
    "EventJournal",
    "event_memory_bytes",
    "event_wire_bytes",
]

#: estimated memory of one kept event beyond its hashes and token ids: the event
#: object, its tuples, the journal's entries for it (sized when these were a
#: (sequence, event) tuple and a deque slot; kept since the journal holds less per
#: event, so that its bound and the pools' estimates stay as they were)
EVENT_BYTES = 288
#: one block hash a kept event holds (a 32-byte ``bytes`` and its slot)
EVENT_HASH_BYTES = 80
#: one token id a kept event holds (an ``int`` object and its tuple slot)
EVENT_TOKEN_BYTES = 40
#: one of a vllm-0.33 BlockStored's per-block tuples (extra keys, look-ahead tokens)
#: and its slot in the event's tuple of them, beyond its items
EVENT_TUPLE_BYTES = 64


def event_memory_bytes(event: KVCacheEvent) -> int:
    """The estimated memory a kept event holds (an upper bound for 32-byte hashes and
    token ids below 2**30; tests/service/test_streams.py measures it)."""
    if type(event) is BlockRemoved:  # (most events: one per evicted block)
        return EVENT_BYTES + EVENT_HASH_BYTES * len(event.block_hashes)
    if isinstance(event, AllBlocksCleared):
        return EVENT_BYTES
    n = EVENT_BYTES + EVENT_HASH_BYTES * len(event.block_hashes)
    if isinstance(event, BlockStored):
        n += EVENT_TOKEN_BYTES * len(event.token_ids) + EVENT_HASH_BYTES
        if event.lora_name:
            n += 64 + len(event.lora_name)
        # vllm-0.33's: each block's look-ahead tokens and extra keys (a tuple each, in
        # a tuple; their keys counted as if none were shared). A request without any
        # leaves a tuple of ``None`` per event, not counted: a plain 0.33 pool's events
        # count as 0.16's, so a whole pool replaced between two takes still fits (budget.py).
        lookahead, extra = event.lookahead_token_ids, event.extra_keys
        if lookahead is not None:
            n += EVENT_TUPLE_BYTES * (1 + len(lookahead)) + EVENT_TOKEN_BYTES * sum(map(len, lookahead))
        if extra is not None and any(keys is not None for keys in extra):
            n += EVENT_TUPLE_BYTES * (1 + len(extra))
            for keys in extra:
                for key in keys or ():
                    n += _extra_key_memory(key)
    return n


def _extra_key_memory(key: object) -> int:
    """An upper bound of what one of a block's extra keys holds (its tuple's slot, the
    key: a string, a digest, or a multimodal key's pair of identifier and offset)."""
    if isinstance(key, str):
        return 8 + 64 + 4 * len(key)
    if isinstance(key, bytes):
        return 8 + 64 + len(key)
    identifier, _offset = cast("tuple[str, int]", key)
    return 8 + EVENT_TUPLE_BYTES + 64 + 4 * len(identifier) + 32


def event_wire_bytes(event: KVCacheEvent) -> int:
    """An upper bound of the event's size as a repeated ``KVEvent`` field of an answer
    (every varint counted at its largest, so no answer cut by it can exceed its budget)."""
    n = 12  # the field's tag and length, the KVEvent's oneof tag and length
    if isinstance(event, AllBlocksCleared):
        return n
    n += len(event.medium) + 6
    for h in event.block_hashes:
        n += len(h) + 6
    if event.group_idx is not None:  # (vllm-0.33's fields from here on)
        n += 6
    if isinstance(event, BlockStored):
        n += 5 * len(event.token_ids) + 6 + 6  # packed ids, their tag and length; block_size
        if event.parent_block_hash is not None:
            n += len(event.parent_block_hash) + 6
        if event.lora_id is not None:
            n += 6
        if event.lora_name is not None:
            n += 4 * len(event.lora_name) + 6
        if event.kv_cache_spec_kind is not None:
            n += 4 * len(event.kv_cache_spec_kind) + 6
        if event.kv_cache_spec_sliding_window is not None:
            n += 6
        for tokens in event.lookahead_token_ids or ():
            n += 12 + 5 * len(tokens)  # an EventTokens: its tag and length, its packed ids'
        for keys in event.extra_keys or ():
            n += 8  # an EventExtraKeys: its tag and length, ``present``
            for key in keys or ():
                n += 12 + _extra_key_bytes(key)  # an EventExtraKey (or a string of ``keys``)
    return n


def _extra_key_bytes(key: object) -> int:
    """An upper bound of one extra key's value in an EventExtraKey: a text's (or a
    string of EventExtraKeys.keys), a digest's, or a multimodal key's identifier and
    offset (sint64)."""
    if isinstance(key, str):
        return 4 * len(key)
    if isinstance(key, bytes):
        return len(key)
    identifier, _offset = cast("tuple[str, int]", key)
    return 6 + 4 * len(identifier) + 11


#: dropped events past which the journal's list is cut (once they are most of it)
_COMPACT_AFTER = 4096

#: a BlockStored as the journal keeps it (:func:`_kept_form`)
_KeptStored = tuple[bytes | tuple[bytes, ...], bytes | None, tuple[int, ...], int]


def _kept_form(event: KVCacheEvent) -> KVCacheEvent | bytes | _KeptStored:
    """What the journal keeps of ``event``, in fewer objects the cyclic collector tracks:
    the journal keeps its events long after the Step that made them, and on a served
    decode Step they were most of the collector's work (every young collection went
    through them, and each one kept went on to the older generations).

    * A BlockRemoved of one hash in the default namespace (no group, on the GPU: one
      per evicted block of a vllm-0.16 pool): its hash alone (``bytes``, never
      tracked; the event and its tuple were two tracked objects).
    * A BlockStored of a vllm-0.16 pool in the default namespace, on the GPU, without
      LoRA: ``(hash or hashes, parent, token ids, block size)``, one hash alone when
      there is one (a tuple of untracked items, which the collector stops tracking the
      first time it sees it; the event and its hashes' tuple were two more).
    * Any other event as it is.

    :func:`_event_of` gives back an event equal to ``event``. (The journal keeps the
    last batch published as it was until the next: :attr:`EventJournal._loose`.)"""
    if type(event) is BlockRemoved:
        if event.medium == MEDIUM_GPU and event.group_idx is None and not event.cache_prefix:
            hashes = event.block_hashes
            if type(hashes) is tuple and len(hashes) == 1 and type(hashes[0]) is bytes:
                return hashes[0]
    elif (
        type(event) is BlockStored
        and event.medium == MEDIUM_GPU
        and event.lora_id is None
        and event.lora_name is None
        and not event.cache_prefix
        and event.group_idx is None
        and event.extra_keys is None
        and event.kv_cache_spec_kind is None
        and event.kv_cache_spec_sliding_window is None
        and event.lookahead_token_ids is None
    ):
        hashes = event.block_hashes
        one = type(hashes) is tuple and len(hashes) == 1 and type(hashes[0]) is bytes
        return (hashes[0] if one else hashes, event.parent_block_hash, event.token_ids, event.block_size)
    return event


def _event_of(kept: KVCacheEvent | bytes | _KeptStored) -> KVCacheEvent:
    """The event the journal keeps as ``kept`` (:func:`_kept_form`)."""
    kind = type(kept)
    if kind is bytes:
        return block_removed(kept)  # type: ignore[arg-type]
    if kind is tuple:
        hashes, parent, token_ids, block_size = cast(_KeptStored, kept)
        return block_stored(
            (hashes,) if type(hashes) is bytes else cast(tuple[bytes, ...], hashes),
            parent, token_ids, block_size, None, None,
        )  # fmt: skip
    return kept  # type: ignore[return-value]


class EventJournal:
    """Events get sequence numbers 1, 2, ...; the newest are kept, at most ``capacity``
    of them and at most ``max_bytes`` of estimated memory (0: no byte bound).

    Readers (watch streams, each session's TakeEvents) read by sequence number and
    can resume after a disconnect, learning of a gap when what they missed is no
    longer kept.

    The kept events are ``_events[_head:]`` (a list whose dropped front is cut off
    now and then), the oldest numbered ``_first``; ``_ends[i]`` is the estimated
    memory of ``_events[:i]`` and then some constant (only differences are read), so
    a Step's events are added and the oldest dropped without a Python step per event.
    """

    def __init__(self, capacity: int, max_bytes: int = 0) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        #: the kept events, each in its kept form (:func:`_kept_form`)
        self._events: list[KVCacheEvent | bytes | _KeptStored] = []
        #: ``_events[_loose:]``, the last batch published, are still the published
        #: objects: made compact at the next publish, so that a reader keeping up (a
        #: session's TakeEvents) gets them without rebuilding them
        self._loose = 0
        self._ends: list[int] = [0]
        self._head = 0
        self._first = 1
        self.last_sequence = 0
        self._changed = asyncio.Event()
        self.closed = False
        #: the last sequence number that is durable (journal mode; None = every event
        #: is): watchers see nothing a crash could take back
        self.durable_sequence: int | None = None

    @property
    def bytes(self) -> int:
        """The estimated memory of the kept events (:func:`event_memory_bytes`)."""
        return self._ends[-1] - self._ends[self._head]

    @property
    def visible_sequence(self) -> int:
        """The newest sequence number a watcher may see."""
        d = self.durable_sequence
        return self.last_sequence if d is None else min(d, self.last_sequence)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def mark_durable(self, sequence: int) -> None:
        """Events up to ``sequence`` are committed: wake watchers waiting for them."""
        if self.durable_sequence is not None and sequence > self.durable_sequence:
            self.durable_sequence = sequence
            self._wake()

    def publish(self, events: Iterable[KVCacheEvent]) -> int:
        """Append events (dropping the oldest past either bound); returns how many were added."""
        if type(events) is not list:
            events = list(events)
        if not events:
            return 0
        ends = self._ends
        sizes = accumulate(map(event_memory_bytes, events), initial=ends[-1])
        next(sizes)
        ends += sizes
        kept = self._events
        loose = max(self._loose, self._head)  # (none of the dropped ones)
        if loose < len(kept):
            kept[loose:] = map(_kept_form, cast(list[KVCacheEvent], kept[loose:]))
        self._loose = len(kept)
        kept += events
        self.last_sequence += len(events)
        self._trim()
        self._wake()
        return len(events)

    def _trim(self) -> None:
        """Drop the oldest events past ``capacity``, then past ``max_bytes`` (keeping
        one at least); the list's dropped front is cut off once it is most of it."""
        events, ends = self._events, self._ends
        end = len(events)
        head = max(self._head, end - self.capacity)
        if self.max_bytes > 0 and head < end and ends[end] - ends[head] > self.max_bytes:
            # the first position from which the kept events fit (ends is non-decreasing)
            head = min(bisect.bisect_left(ends, ends[end] - self.max_bytes, head), end - 1)
        self._first += head - self._head
        if head > _COMPACT_AFTER and head > end >> 1:
            del events[:head], ends[:head]
            self._loose = max(self._loose - head, 0)
            head = 0
        self._head = head

    @property
    def oldest_sequence(self) -> int:
        return self._first

    def since(
        self, after: int, limit: int | None = None, upto: int | None = None
    ) -> list[tuple[int, KVCacheEvent]]:
        """Kept events with a sequence number above ``after`` (and at most ``upto``), oldest first."""
        last = self.last_sequence if upto is None else min(upto, self.last_sequence)
        first = max(after + 1, self._first)
        if limit is not None:
            last = min(last, first + limit - 1)
        if first > last:
            return []
        at = self._head - self._first
        part: Iterable[KVCacheEvent | bytes | _KeptStored] = self._events[at + first : at + last + 1]
        if at + first < self._loose:  # (else all of the last batch: as published)
            part = map(_event_of, part)
        return list(zip(range(first, last + 1), cast(Iterable[KVCacheEvent], part), strict=True))

    def missed(self, after: int) -> bool:
        """True when events after sequence ``after`` were dropped unread."""
        return after < self.last_sequence and after + 1 < self.oldest_sequence

    def deliverable(self, after: int) -> bool:
        """True when a kept, visible event above ``after`` exists."""
        return max(after + 1, self.oldest_sequence) <= self.visible_sequence

    async def wait(self, after: int, timeout: float) -> None:
        """Return when a deliverable event above ``after`` exists (:meth:`deliverable`),
        the journal closes, or after ``timeout``. Suspends in every other case: events
        published or committed while none is deliverable yet (a commit behind the oldest
        kept event) wake it only to check again."""
        deadline = time.monotonic() + timeout
        while not (self.closed or self.deliverable(after)):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the
                # result when its inner wait ends in the same turn as a cancellation of
                # the waiting task, and the cancellation is lost (a closed watch stream
                # kept waiting)
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                return

    def restore(self, events: list[tuple[int, KVCacheEvent]], last_sequence: int) -> None:
        """Load kept events and the sequence counter (recovery).

        Raises:
            ValueError: the events are not numbered one after another up to ``last_sequence``.
        """
        first = last_sequence + 1 - len(events)
        if [seq for seq, _ in events] != list(range(first, last_sequence + 1)):
            raise ValueError(f"kept events must be numbered {first}..{last_sequence}, one after another")
        self._events = [_kept_form(e) for _, e in events]
        self._loose = len(self._events)
        self._ends = [0, *accumulate(event_memory_bytes(e) for _, e in events)]
        self._head = 0
        self._first = first
        self.last_sequence = last_sequence
        self._trim()

    def resize(self, capacity: int) -> None:
        """Keep the newest ``capacity`` events from now on (a limit changed at restart)."""
        self.capacity = capacity
        self._trim()

    def kept(self) -> list[tuple[int, KVCacheEvent]]:
        """The kept events, oldest first (snapshots)."""
        return self.since(0)

    def close(self) -> None:
        self.closed = True
        self._wake()
