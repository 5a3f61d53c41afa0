"""What a predicted session reports, read from its mirror: the KV events and
statistics of each scheduler step (taking the events ends the step), the pool's usage,
and the sender's counters. :class:`~.predicting.PredictingKVCacheManager` is built on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcoord.engine import KVCacheEvent, PrefixCacheStats
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import event_to_pb, stats_to_pb

from .mirror import Mirror
from .sender import StepSender
from .session import SessionKeeper
from .session_facts import SessionFacts

__all__ = ["PredictedReports"]


class PredictedReports(SessionFacts):
    """The reporting half of vLLM's KVCacheManager interface over a mirror."""

    #: what the engine's events are given as (see :meth:`convert_events_with`)
    event_converter: Callable[[list[KVCacheEvent]], list[Any]] | None = None
    mirror: Mirror
    sender: StepSender
    keeper: SessionKeeper
    log_stats: bool

    def convert_events_with(self, convert: Callable[[list[KVCacheEvent]], list[Any]]) -> None:
        """From now on, :meth:`take_engine_events` gives what ``convert`` makes of the
        engine's events, made as each call makes them (vLLM's adapter: vLLM's types)."""
        self.event_converter = self.mirror.convert = convert
        self.mirror.events = convert(self.mirror.events)

    @property
    def steps_sent(self) -> int:
        return self.sender.steps_sent

    @property
    def waited_seconds(self) -> float:
        return self.sender.waited_seconds

    @property
    def events_gaps(self) -> int:
        return self.sender.events_gaps

    def peek_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """What make_prefix_cache_stats would return, without resetting it."""
        if not self.log_stats:
            return None
        return stats_to_pb(self.mirror.peek_stats())

    def peek_engine_stats(self) -> PrefixCacheStats | None:
        """:meth:`peek_prefix_cache_stats` as the engine's value (no message made)."""
        return self.mirror.peek_stats() if self.log_stats else None

    @property
    def usage(self) -> float:
        return self.mirror.usage

    def take_events(self) -> list[pb.KVEvent]:
        """The pool's KV events since the previous call; ends a scheduler step (its
        calls go to the server, or join the next Step while one is in flight)."""
        assert self.event_converter is None, "the events are converted (convert_events_with)"
        return [event_to_pb(e) for e in self.take_engine_events()]

    def take_engine_events(self) -> list[Any]:
        """:meth:`take_events` as the engine's values (no message made), or what
        :meth:`convert_events_with`'s function made of them."""
        self._cut()
        return self.mirror.take_events()

    def make_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """This session's prefix-cache statistics since the previous call."""
        return stats_to_pb(self.take_engine_stats())

    def take_engine_stats(self) -> PrefixCacheStats | None:
        """:meth:`make_prefix_cache_stats` as the engine's value (no message made: what
        vLLM's adapter converts)."""
        return self.mirror.take_stats() if self.log_stats else None

    def take_changed_stats(self) -> PrefixCacheStats | None:
        """:meth:`take_engine_stats` with stats on, or ``None`` when nothing was recorded
        since the previous call (every count 0: no object made for it)."""
        return self.mirror.take_changed_stats()

    def _cut(self, wait: bool = False) -> None:
        """End a scheduler step (the manager's: its calls go to the server)."""
        raise NotImplementedError
