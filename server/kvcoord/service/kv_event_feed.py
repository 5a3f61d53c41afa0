"""What each ``[[kv_events]]`` publisher (kv_publisher.py, whose docstring tells the
whole protocol) is handed: its pool's committed events, in journal order, in batches,
with the clears a deletion, a new incarnation, a first look or a gap calls for
(:func:`follow`); and the server's publishers with the tasks feeding them
(:class:`Publishers`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from kvcoord.engine import AllBlocksCleared, KVCacheEvent
from kvcoord.engine.profiles import VLLM_016

from .kv_event_index import StoredSinceGap
from .kv_events_config import KVEventsDecl
from .kv_publisher import KVEventPublisher
from .logs import ids
from .registry import PoolRegistry
from .tasks import cancel_and_wait

__all__ = ["Publishers", "follow"]

logger = logging.getLogger(__name__)


async def follow(
    registry: PoolRegistry,
    publisher: KVEventPublisher,
    poll_seconds: float = 1.0,
    on_gap: Callable[[str], None] = lambda pool: None,
) -> None:
    """Hand every committed event of the publisher's pool to it, in batches, forever.

    Events dropped from the pool's buffer before they were read here (``event_buffer``
    or its byte bound) cannot be sent, and vLLM's format has no gap of its own (the
    batches are numbered by the publisher, so theirs stay consecutive): a subscriber
    would keep hashes whose removal it never saw, and miss some stored. So an
    ``AllBlocksCleared`` goes first (``on_gap`` is told): its index starts over from
    what follows, which holds no block the pool does not cache, and no removal of a
    block stored before the clear (:class:`StoredSinceGap`). Only the events of
    the publisher's tenant's namespace are sent (a namespace the pool has not seen
    yet: only clears), as WatchEvents gives that tenant."""
    decl = publisher.decl
    incarnation: int | None = None
    cursor = 0
    #: the pool's profile (the format of its batches), kept for its deletion's clear
    profile = VLLM_016
    #: sent before the first events read after the server started (see below)
    head: list[KVCacheEvent] = []
    since_gap = StoredSinceGap()
    while True:
        service = registry.pools.get(decl.pool)
        if service is None:
            if incarnation is not None:  # deleted: its cache is gone
                publisher.submit([AllBlocksCleared()], profile)
                incarnation = None
                since_gap.stop()
            await asyncio.sleep(poll_seconds)
            continue
        journal = service.events
        if service.fence.incarnation != incarnation:
            if incarnation is not None:  # created again: the old cache is gone
                publisher.submit([AllBlocksCleared()], profile)
            elif journal.last_sequence:
                # The first look at the pool (since the server started, or it came to this
                # replica) sends again what the pool keeps, a clear first: its subscribers may
                # hold anything of it (an index from before a restart, the clear of its
                # departure, nothing), and applied, the batch leaves any index exactly the
                # pool's map when the events are its whole history. (Without the clear, a count
                # index that applied them before counted them twice, and kept a block once its
                # removal came.)
                head = [AllBlocksCleared()]
            incarnation = service.fence.incarnation
            since_gap.stop()
            if journal.missed(0):
                # Events were dropped (event_buffer) before this publisher sent them: a gap,
                # as for a WatchEvents reader from 0 (blocks they stored may still be cached);
                # the kept ones' removals of blocks stored before them are left out, as after
                # one (no subscriber holds those: docs/routing.md's count raised KeyError)
                logger.warning(
                    "pool %s: KV events 1..%d were dropped before the publisher's first look (event_buffer)",
                    decl.pool, journal.oldest_sequence - 1, extra=ids(pool=decl.pool),
                )  # fmt: skip
                since_gap.start()
                on_gap(decl.pool)
            profile = service.config.profile
            publisher.follow_profile(profile)  # replays are framed as its profile's from now on
            cursor = journal.oldest_sequence - 1
        if journal.missed(cursor):
            logger.error(
                "pool %s: KV events were dropped before the publisher read them (event_buffer): "
                "subscribers are sent a clear, and their indexes start over", decl.pool, extra=ids(pool=decl.pool),
            )  # fmt: skip
            head = [AllBlocksCleared()]
            since_gap.start()
            on_gap(decl.pool)
        items = journal.since(cursor, limit=4096, upto=journal.visible_sequence)
        if not items:
            await journal.wait(cursor, poll_seconds)
            continue
        cursor = items[-1][0]
        namespace = service.cache_namespace(decl.tenant)
        prefix = service.cache_prefix_of(namespace) if namespace else b""  # (None: not seen yet)
        events = head + since_gap.keep(
            [
                e
                for _, e in items
                if isinstance(e, AllBlocksCleared) or (prefix is not None and e.cache_prefix == prefix)
            ]
        )
        head = []
        if events:
            publisher.submit(events, profile)
        await asyncio.sleep(0)  # let Steps run between large batches


class Publishers:
    """The server's KV event publishers and the tasks that feed them."""

    def __init__(
        self,
        decls: Sequence[KVEventsDecl],
        registry: PoolRegistry,
        poll_seconds: float = 1.0,
        data_dir: str | Path | None = None,
        on_gap: Callable[[str], None] = lambda pool: None,
    ) -> None:
        pools = registry.pools
        self.publishers = {
            d.pool: KVEventPublisher(
                d, data_dir, pools[d.pool].config.profile if d.pool in pools else VLLM_016, on_gap
            )
            for d in decls
        }
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(follow(registry, p, poll_seconds, on_gap)) for p in self.publishers.values()
        ]
        for p in self.publishers.values():
            logger.info(
                "pool %s: KV events in vLLM's format on %s%s",
                p.decl.pool,
                p.endpoint,
                f" (replay {p.replay_endpoint})" if p.replay_endpoint else "",
                extra=ids(pool=p.decl.pool),
            )

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        for p in self.publishers.values():
            await asyncio.to_thread(p.close)
