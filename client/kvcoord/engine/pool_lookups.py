"""Prefix lookups: the hit of a registered request or of bare hashes, a client's
answered lookup checked, reservations held for routers, and lookup-then-allocate in
one call (the hit cannot go stale between the two).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .errors import FailedPreconditionError, InvalidArgumentError
from .hash_list import request_keys
from .pool_vllm033 import Pool033Calls
from .request_table import check_count
from .reservations import Reservation, read_by_eagle_search
from .results import AllocationResult, BlockIds, CacheHit


class PoolLookups(Pool033Calls):
    """:class:`~kvcoord.engine.pool.KVCachePool`'s lookup calls."""

    #: the general allocation (:class:`~kvcoord.engine.pool.KVCachePool`)
    allocate_slots: Callable[..., BlockIds | None]

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        """The longest prefix hit of at most ``num_tokens - 1`` tokens (records stats).

        Returns an empty hit, without stats, when caching is off or the request skips
        reading the prefix cache.
        """
        req = self._get(request_id)
        return self._lookup(req)

    def lookup_hint(self, request_id: str, walk_limit: int = 4096) -> tuple[CacheHit, int]:
        """What :meth:`get_computed_blocks` would answer now, and the hit's eviction
        margin; records nothing.

        A client that is the pool's only user can keep answering the request's lookup
        with this hit while it can prove nothing changed it: no more than ``margin``
        blocks left the free queue (new blocks plus adopted hit blocks) and none of the
        request's hashes past the hit was cached since (see :meth:`check_lookup`).

        Args:
            walk_limit: the most free-queue positions to walk (the margin's cap).
        """
        return self.hits.hint(self._get(request_id), walk_limit)

    def check_lookup(
        self, request_id: str, answered: CacheHit | Sequence[Sequence[int]], num_tokens: int
    ) -> CacheHit:
        """:meth:`get_computed_blocks` for a lookup the client already answered with
        ``answered`` (``num_tokens`` long): the same search and statistics, but a
        different hit raises instead of being returned.

        Raises:
            HintMismatchError: the pool's hit differs; nothing is recorded.
        """
        req = self._get(request_id)
        hit = (
            answered if isinstance(answered, CacheHit) else CacheHit(tuple(map(tuple, answered)), num_tokens)
        )
        return self.hits.check_answered(req, hit)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], num_tokens: int, cache_namespace: str = ""
    ) -> CacheHit:
        """The hit :meth:`get_computed_blocks` would give a request of ``num_tokens``
        tokens with these block hashes, changing nothing.

        Same search (at most ``num_tokens - 1`` tokens, EAGLE's drop, the hybrid fixed
        point, LCM alignment), but no request is registered, no block is touched or
        moved in the free queue, and no statistic, counter or event is recorded. Like
        any hit, the answer is a hint valid until the pool's next mutation.

        Args:
            block_hashes: the request's hashes, one per full ``hash_block_size`` block of
                its tokens (ignored when caching is off).
            num_tokens: the request's token count, ``1 .. max_model_len``.
            cache_namespace: search this namespace's cached blocks only (see
                :meth:`add_request`).

        Returns:
            The hit; empty (one empty list per group) when caching is off.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not an integer in
                ``1 .. max_model_len``, or the hashes are not exactly one per full block
                (count, type, length).
        """
        return self.hits.find_longest_cache_hit(block_hashes, num_tokens, cache_namespace)

    def reserve(
        self, reservation_id: str, block_hashes: Sequence[bytes], num_tokens: int, cache_namespace: str = ""
    ) -> CacheHit:
        """:meth:`find_longest_cache_hit`, then hold the hit's blocks against eviction
        until a request of this prompt adopts them (:meth:`adopt_reservation`) or
        :meth:`release_reservation`. An empty hit holds nothing and is not kept.

        Raises:
            InvalidArgumentError: as :meth:`find_longest_cache_hit`, or the id is live.
        """
        if reservation_id in self.reservations.live:
            raise InvalidArgumentError(f"reservation {reservation_id!r} already exists")
        hit = self.hits.find_longest_cache_hit(block_hashes, num_tokens, cache_namespace)
        if hit.num_tokens:
            # a hit means the namespace has cached blocks, so it has its prefix already
            prefix = self.cache_namespaces[cache_namespace] if cache_namespace else b""
            held: Sequence[Sequence[int]] = hit.block_ids
            if self.config.use_eagle:
                held = read_by_eagle_search(
                    self.hits, self.config, request_keys(block_hashes, prefix), num_tokens
                )
            self.reservations.hold(reservation_id, hit, held, prefix, block_hashes, num_tokens)
        return hit

    def release_reservation(self, reservation_id: str) -> bool:
        """End a reservation no request adopted; ``False`` when it is not live."""
        return self.reservations.expire(reservation_id)

    def adopt_reservation(self, request_id: str, got_tokens: int) -> Reservation | None:
        """The request made its first allocation with a hit of ``got_tokens``: release
        the oldest reservation made for its prompt (same namespace, hashes and token
        count; call after the allocation, so blocks it shares keep their place)."""
        req = self._get(request_id)
        return self.reservations.adopt(req.cache_prefix, req.block_hashes, req.num_tokens, got_tokens)

    def allocate_slots_with_lookup(
        self,
        request_id: str,
        max_num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_in_flight_tokens: int = 0,
        watermark_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> AllocationResult:
        """Look up the prefix and allocate in one step, so the hit cannot go stale.

        Does what vLLM's scheduler does for a waiting request:
        ``num_new_tokens = min(num_tokens - hit - external, max_num_new_tokens)``.
        In a vllm-0.33 pool the lookup is counted in the statistics only when the
        allocation succeeds (vLLM 0.33 counts admissions).

        Raises:
            FailedPreconditionError: the request already holds blocks or has
                computed tokens (only a waiting request looks up its prefix).
            InvalidArgumentError: see :meth:`allocate_slots`.
        """
        req = self._get(request_id)
        check_count(max_num_new_tokens, "max_num_new_tokens")
        check_count(num_external_computed_tokens, "num_external_computed_tokens")
        if req.num_computed_tokens or any(self.coordinator.get_blocks(request_id)):
            raise FailedPreconditionError(
                f"request {request_id!r} is already running (it has computed tokens or "
                "holds blocks); only a waiting request looks up its prefix"
            )
        if num_external_computed_tokens >= req.num_tokens:
            raise InvalidArgumentError(
                f"num_external_computed_tokens {num_external_computed_tokens} must be "
                f"smaller than the request's {req.num_tokens} tokens"
            )
        if max_num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidArgumentError(
                "max_num_new_tokens must be > 0 unless num_external_computed_tokens is > 0"
            )
        # Search first, allocate, and record the lookup only once the allocation did
        # not raise: a failed call leaves statistics and counters untouched.
        if not self.enable_caching or req.skip_reading_prefix_cache:
            hit, lists = CacheHit(self._no_new_blocks, 0), None
            req.shared_prefix_boundary = 0
        else:
            hit, lists = self._search(
                request_keys(req.block_hashes, req.cache_prefix), len(req.all_token_ids)
            )
            self.hits.note_junction(req, hit.num_tokens)
        num_new = min(req.num_tokens - hit.num_tokens - num_external_computed_tokens, max_num_new_tokens)
        if num_new < 0:
            num_new = 0
        # vllm-0.33, a "full" report-mode request: its lookup's events come before the
        # allocation's, and only once the allocation did not raise (refused: kept)
        hit_events = self.hits.hit_events(req, hit) if lists is not None else []
        queued = len(self.block_pool.kv_event_queue)
        last_hit = req.last_hit
        fresh = req.last_hit = (hit.block_ids, self.block_pool.hash_epoch)  # trusted by allocate_slots
        try:
            new = self.allocate_slots(
                request_id,
                num_new,
                hit.num_tokens,
                hit,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                num_in_flight_tokens,
                watermark_blocks,
                skip_zeroing_group_ids,
            )
        except Exception:
            req.last_hit = last_hit
            raise
        if hit_events:
            self.block_pool.kv_event_queue[queued:queued] = hit_events
        if lists is not None:
            self._record_lookup(req, hit, lists)
            req.last_hit = fresh
            if new is not None and self.rules.stats_at_admission:
                self.hits.record_admission(req, hit.num_tokens)
        return AllocationResult(hit, num_new, new)
