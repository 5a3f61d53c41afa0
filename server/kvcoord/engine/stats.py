"""Prefix-cache statistics, as vLLM's ``PrefixCacheStats``."""

from __future__ import annotations

import dataclasses

__all__ = ["PrefixCacheStats"]


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
