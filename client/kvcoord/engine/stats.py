"""Prefix-cache statistics, as vLLM's ``PrefixCacheStats``."""

from __future__ import annotations

import dataclasses

__all__ = ["LookupCounters", "PrefixCacheStats"]


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    """Lookups since the last ``make_prefix_cache_stats``.

    ``queries`` counts all of a request's tokens at lookup time (not the capped search
    length) and ``hits`` the tokens found; lookups of requests preempted at least once
    go to the ``preempted_*`` triple. ``reset`` is set by a successful prefix-cache reset.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def copy(self) -> PrefixCacheStats:
        return dataclasses.replace(self)


@dataclasses.dataclass(slots=True)
class LookupCounters:
    """Lifetime lookup counters of a pool, never reset (the service exports them).

    ``queries``/``hits`` count tokens like :class:`PrefixCacheStats` (same lookups:
    none when caching is off or the request skips reading the cache);
    ``group_hit_tokens[g]`` is the tokens group g's hit covers (null blocks included);
    ``short_lookups`` counts lookups whose searchable length (``num_tokens - 1``) was
    shorter than the pool's hit alignment, so no hit was possible.
    """

    lookups: int = 0
    queries: int = 0
    hits: int = 0
    short_lookups: int = 0
    group_hit_tokens: list[int] = dataclasses.field(default_factory=list)
