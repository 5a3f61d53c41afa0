"""Lookup hints of the exclusive waiting mode: lookups answered ahead, and what they
stay valid under.

With an exclusive session and a scheduler that names the requests it will look up
next, the round trip that answers one lookup fetches hints for the next ones
(``hint_lookup``). :class:`LookupHints` keeps them with what could make one wrong:
blocks that may have left the free queue since (against each hint's eviction margin)
and hashes this session may have cached since (a hit may have grown). The manager
answers a lookup from a hint only while :meth:`LookupHints.still_holds` says so and its
session is sound; the server checks every such answer when it records the lookup
(``PREDICTION_FAILED`` otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .items import KVCacheBlockIds

__all__ = ["Hint", "LookupHints"]


@dataclasses.dataclass(slots=True)
class Hint:
    """A lookup's answer fetched ahead, and what it stays valid under."""

    hit: KVCacheBlockIds
    tokens: int
    #: blocks that may leave the free queue before a block of the hit could be reused
    margin: int
    #: the request's length when looked up
    num_tokens: int
    #: caching any hash of the request from this index on may change the hit
    watch_from: int


class LookupHints:
    """One manager's hints, by request and by block, and what may invalidate them.

    Args:
        hash_block_size: tokens per block hash.
        single_full: the pool has one full-attention group (a hit can then only grow
            when the hash right after it is cached; on any other layout, when any hash
            of the request is).
    """

    def __init__(self, hash_block_size: int, single_full: bool) -> None:
        self.hash_block_size = max(1, hash_block_size)
        self.single_full = single_full
        self.by_request: dict[str, Hint] = {}
        #: hint blocks by id (with a ledger: a freed one lowers its hints' margins)
        self.by_block: dict[int, list[Hint]] = {}
        #: blocks that may have left the free queue since the hints were made
        self.moved = 0
        #: hashes this session may have cached since the hints were made
        self.newly_cached: set[bytes] = set()
        #: per request, how many of its hashes its allocations and cache_blocks cached
        self.cached_hashes: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.by_request)

    def clear(self) -> None:
        """Drop every hint (what they relied on can no longer be followed)."""
        self.by_request.clear()
        self.by_block.clear()
        self.moved = 0
        self.newly_cached = set()

    def reset(self) -> None:
        """A new session: no hint, and nothing known cached."""
        self.clear()
        self.cached_hashes.clear()

    def forget(self, request_id: str) -> None:
        """What the request cached is unknown (freed, lost, or allocated unfollowed)."""
        self.cached_hashes.pop(request_id, None)

    def admitted(self, request_id: str) -> None:
        """The request is allocated: its next lookup (if any) is another."""
        if self.by_request:
            self.by_request.pop(request_id, None)

    def taking(self, count: int) -> None:
        """At most ``count`` blocks leave the free queue."""
        self.moved += count

    def still_holds(self, hint: Hint, request: Any, hashes: Callable[[], Sequence[Any]]) -> bool:
        """Whether the pool would still answer this request's lookup with ``hint``, as
        far as blocks moved and hashes cached tell (``hashes`` gives the request's)."""
        if self.moved > hint.margin or len(request.all_token_ids) != hint.num_tokens:
            return False
        cached = self.newly_cached
        if cached:
            known = hashes()
            for i in range(hint.watch_from, len(known)):
                if bytes(known[i]) in cached:
                    return False
        return True

    def adopt(
        self,
        requests: Sequence[Any],
        answers: Iterable[tuple[KVCacheBlockIds, int, int] | None],
        cap: int,
        tracked: bool,
    ) -> None:
        """Hints for ``requests`` from their hint lookups' answers (None: that one
        failed and takes a round trip), margins capped at ``cap``; ``tracked``: the
        ledger sees every free, so a hit block freed lowers its hints' margins."""
        for r, answer in zip(requests, answers, strict=True):
            if answer is None:
                continue
            hit, tokens, margin = answer
            hint = Hint(
                hit,
                tokens,
                min(margin, cap),
                len(r.all_token_ids),
                tokens // self.hash_block_size if self.single_full else 0,
            )
            self.by_request[r.request_id] = hint
            if tracked:
                for group in hit.block_ids:
                    for b in group:
                        if b:
                            self.by_block.setdefault(b, []).append(hint)

    def cached(
        self, request: Any, num_tokens: int, cached_before: int, hashes: Callable[[], Sequence[Any]]
    ) -> None:
        """The pool caches the request's blocks up to ``num_tokens`` (those below
        ``cached_before`` tokens, an adopted hit, are cached already): remember which of
        its hashes that may add, while hints are held."""
        rid = request.request_id
        size = self.hash_block_size
        count = num_tokens // size
        prev = max(self.cached_hashes.get(rid, 0), cached_before // size)
        if count > prev:
            self.cached_hashes[rid] = count
            if self.by_request:
                self.newly_cached.update(bytes(h) for h in hashes()[prev:count])

    def caches_nothing_new(self, request_id: str, num_tokens: int) -> bool:
        """Whether caching up to ``num_tokens`` adds no hash this session did not cache."""
        return num_tokens // self.hash_block_size <= self.cached_hashes.get(request_id, 0)

    def released(self, ids: Sequence[int], free: int | None) -> None:
        """Blocks a queued call frees: a hint block among them lowers its hints'
        margins (it waits behind every block free now)."""
        if self.by_block and ids:
            limit = self.moved + (free or 0)
            for b in ids:
                for hint in self.by_block.get(b, ()):
                    hint.margin = min(hint.margin, limit)
