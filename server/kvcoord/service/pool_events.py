"""A pool's events and prefix-cache statistics as its sessions and watchers read them:
the engine's events moved into the pool's journal, each session's take since its
cursor (its cache namespace only, cut to a budget), WatchEvents' filter, and each
session's statistics. A part of :class:`~.pool_service.PoolService` (its
``event_feed``); the journal itself is the pool's (``PoolService.events``)."""

from __future__ import annotations

from collections.abc import Callable

from kvcoord.engine import AllBlocksCleared, KVCacheEvent, PrefixCacheStats

from . import operations as op
from .events import event_wire_bytes
from .pool_core import PoolCore
from .sessions import Session


class PoolEvents:
    """Events and statistics of one pool's sessions."""

    def __init__(self, pool: PoolCore) -> None:
        self.pool = pool

    def publish(self) -> None:
        """Move the engine's new events into the pool's journal."""
        events = self.pool.engine.take_events()
        if events:
            self.pool.events.publish(events)

    def take_events(
        self,
        s: Session,
        max_bytes: int | None = None,
        max_event_bytes: int | None = None,
        max_events: int | None = None,
    ) -> op.EventsTaken:
        """The events of the session's cache namespace since its previous take (its
        cursor moves).

        A session sees what vLLM's own manager would show it: blocks stored and removed
        in its own namespace (tenants with isolated caches never see each other's token
        ids or hashes), and every AllBlocksCleared. Without namespaces (no tenants, or a
        shared cache) that is every event of the pool. WatchEvents filters alike
        (:meth:`events_filter`).

        Args:
            max_bytes: the answer's budget for events (their :func:`event_wire_bytes`):
                the events are cut before the first that would pass it, ``more`` is
                set and the cursor stays after the last one given, so the next take
                continues there (None: no budget).
            max_event_bytes: the most one event may take in any answer: a larger one
                could never be given, so it is dropped for this session with ``gap``
                set (None: ``max_bytes``).
            max_events: at most this many events, cut the same way (a replay of an
                answer that was cut gives as many events as it held: the cursor ends
                where it did).
        """
        self.publish()
        journal = self.pool.events
        gap = journal.missed(s.events_cursor)
        kept = journal.since(s.events_cursor)
        prefix = None
        if self.pool.engine.cache_namespaces:  # else every event is of the default namespace
            prefix = self.pool.engine.cache_namespace_prefix(s.cache_namespace)
        if max_bytes is None and max_events is None and prefix is None:
            s.events_cursor = journal.last_sequence
            return op.EventsTaken([e for _, e in kept], gap)
        largest = max_bytes if max_event_bytes is None else max_event_bytes
        events: list[KVCacheEvent] = []
        used = 0
        more = False
        cursor = journal.last_sequence
        for seq, e in kept:
            if prefix is not None and not isinstance(e, AllBlocksCleared) and e.cache_prefix != prefix:
                continue
            if max_events is not None and len(events) >= max_events:
                more = True
                cursor = seq - 1
                break
            if max_bytes is not None:
                size = event_wire_bytes(e)
                if used + size > max_bytes:
                    if largest is not None and size > largest:
                        gap = True  # no answer can carry it
                        continue
                    more = True
                    cursor = seq - 1
                    break
                used += size
            events.append(e)
        s.events_cursor = cursor
        return op.EventsTaken(events, gap, more)

    def events_filter(self, tenant: str, administers: bool) -> Callable[[KVCacheEvent], bool] | None:
        """Which of the pool's events a watcher of ``tenant`` may read (WatchEvents):
        ``None`` (every event) for the full-access tenant and a tenant administering
        the pool; else those of its own cache namespace (``PoolService.cache_namespace``), as
        :meth:`take_events` gives its sessions, and every AllBlocksCleared. A namespace
        the pool has not seen yet (the tenant never attached) matches no event until it
        appears; looking it up registers nothing (replay assigns prefixes in attach order)."""
        if not tenant or administers:
            return None
        namespace = self.pool.cache_namespace(tenant)
        engine = self.pool.engine

        def visible(event: KVCacheEvent) -> bool:
            if isinstance(event, AllBlocksCleared):
                return True
            prefix = engine.cache_namespaces.get(namespace) if namespace else b""
            return prefix is not None and event.cache_prefix == prefix

        return visible

    def make_stats(self, s: Session) -> PrefixCacheStats | None:
        """The session's statistics since its previous make, then reset."""
        if s.stats is None:
            return None
        stats, s.stats = s.stats, PrefixCacheStats()
        return stats
