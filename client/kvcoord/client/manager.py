"""``RemoteKVCacheManager``: vLLM's KVCacheManager interface, served by a kvcoord pool.

A scheduler that calls ``get_computed_blocks`` / ``allocate_slots`` / ``free`` on vLLM's
in-process manager can call the same methods here. Requests are any objects with the
attributes vLLM's ``Request`` has (``request_id``, ``all_token_ids``,
``num_computed_tokens``; optionally ``block_hashes``, ``lora_request``, ``cache_salt``,
``skip_reading_prefix_cache``, ``num_preemptions``, ``mm_items``). Block hashes are taken
from ``request.block_hashes`` when present, else computed here with the pool's hash
settings. Only what changed since the last call is sent.

Round trips: calls whose answer nobody waits for (``free``, ``cache_blocks``,
``remove_skipped_blocks``, ``evict_blocks``) are queued and ride with the next call
that needs an answer. Every answer carries the pool's usage and this session's new
events and statistics, so ``usage``, ``take_events`` and ``make_prefix_cache_stats``
usually cost nothing. Every other call waits for the server's answer: this manager
decides nothing itself (it is the waiting mode; an exclusive pool's client that can
mirror its pool answers at once with :class:`PredictingKVCacheManager` instead).

vLLM's scheduler calls ``free`` for finished and preempted requests alike; a freed
request that comes back is registered again with all its tokens (its
``num_preemptions`` keeps the prefix-cache statistics exact).

Safety: the manager keeps its session alive on a background thread and never hands
out block ids once its lease may have ended. Every request change names the position
it applies at; a call whose outcome is unknown is retried with the same idempotency
key. When requests are lost anyway (the session expired, the server restarted, an
outcome could not be settled, the positions disagree), the call raises
:class:`RequestsLostError` naming them, after re-attaching or cleaning up, so the
scheduler can preempt and recompute them; the next call works normally.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvcoord.v1 import allocator_pb2 as pb

from .batch import Ops, StepBatcher
from .client import KVCoordClient
from .errors import (
    AbortedError,
    AnswerEvictedError,
    FencedError,
    KVCoordError,
    LeaseExpiredError,
    OutcomeUnknownError,
    PermissionDeniedError,
    RequestsLostError,
    RequestUnknownError,
    ResourceExhaustedError,
    SessionExpiredError,
    SyncMismatchError,
    UnavailableError,
    error_from_code,
    status_code,
)
from .hashing import pool_seed
from .items import Item, KVCacheBlockIds, Pending
from .session import LEASE_MARGIN, SessionKeeper
from .tracking import RequestTracker

__all__ = ["KVCacheBlockIds", "Pending", "RemoteKVCacheManager", "StepBatcher"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_STAT_FIELDS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")


#: empty Steps take_events sends at most to fetch events the server cut from answers
#: (StepResponse.events_more); each answer carries up to max_message_bytes of them
MAX_EVENT_ROUNDS = 64


#: errors after which a free is sent again with the next Step (the server may answer
#: it then); any other refusal would refuse it again
_TRANSIENT = (UnavailableError, AbortedError, ResourceExhaustedError, LeaseExpiredError)

#: queued operations that make no KV events (nor does a run of checks alone)
_NO_EVENTS = ("free", "remove_skipped_blocks", "lookup", "get_block_ids")


def _touched(items: list[Item]) -> list[str]:
    """The requests a Step's items sync (only theirs roll back when it fails: calls
    collected in an open batch keep theirs)."""
    return [rid for i in items for rid in i.touched]


class RemoteKVCacheManager:
    """vLLM KVCacheManager methods over a kvcoord pool.

    Args:
        client: a connected :class:`KVCoordClient`.
        pool: the pool's name (create it first, e.g. with ``client.create_pool``).
        hash_seed: the seed workers hash with; defaults to ``$PYTHONHASHSEED``. A remote
            pool is refused without one, since random seeds never match across processes.
        client_name: shown in server logs.
        lease_seconds: the session lease to ask for (0 = the server's default).
        renew: renew the lease on a background thread (turn off only in tests).
        exclusive: be the pool's only session (another session is refused while this one
            lives). Answers still wait for the server, as on a shared pool: answering
            at once is :class:`PredictingKVCacheManager`'s (the engine mirrored).
        profile, num_hash_lookahead_tokens: the semantics profile the caller follows
            (``vllm-0.16`` when empty, or ``vllm-0.33``) and its look-ahead hash tokens,
            checked by the handshake: a pool of another profile is refused.

    Raises:
        RandomSeedError: caching is on and no seed is known.
        HashMismatchError: the pool hashes differently.
        FailedPreconditionError: ``exclusive`` and the pool has another session.
    """

    def __init__(
        self,
        client: KVCoordClient,
        pool: str,
        *,
        hash_seed: str | None = None,
        client_name: str = "",
        lease_seconds: float = 0,
        renew: bool = True,
        exclusive: bool = False,
        profile: str = "",
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        self.client = client
        self.pool = pool
        info = client.get_pool(pool).pool
        cfg = info.config
        self.config = cfg
        self.enable_caching = cfg.enable_caching
        seed, none = pool_seed(cfg, hash_seed)
        self.tracker = RequestTracker(cfg, none)
        self.exclusive = exclusive
        self.keeper = SessionKeeper(
            client,
            # the semantics profile the caller follows is part of the handshake ("": vllm-0.16)
            lambda: client.attach(
                pool,
                cfg.hash_algo,
                cfg.hash_block_size,
                seed or "",
                client_name,
                lease_seconds,
                exclusive,
                profile=profile,
                num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            ),
            renew=renew,
        )
        self.num_groups = len(cfg.groups)
        self.log_stats = cfg.log_stats if cfg.HasField("log_stats") else True
        self._ops = Ops(self)
        #: calls sent with the next Step (frees, cache_blocks, remove_skipped_blocks, ...)
        self._queue: list[Item] = []
        self._usage: float | None = None
        self._events: list[pb.KVEvent] = []
        #: the last answer's events were cut (StepResponse.events_more): more wait
        self._events_more = False
        self._stats = pb.PrefixCacheStats()
        self._reattach = False
        #: allocate_slots calls answered None because the hit had gone stale (another
        #: worker reused its blocks after the lookup); the scheduler looks up again.
        self.stale_hits = 0
        #: requests reported lost (RequestsLostError) since the manager was created
        self.lost_requests = 0
        #: Step round trips sent, and the seconds spent waiting on them (from sending
        #: the request to holding the answer)
        self.round_trips = 0
        self.round_trip_seconds = 0.0
        #: set by KVCoordScheduler (the requests it will look up next); unused: every
        #: lookup waits for the server's answer
        self.upcoming: Callable[[Any], Iterable[Any]] | None = None

    @property
    def session_id(self) -> str:
        return self.keeper.session_id

    def batch(self) -> StepBatcher:
        """Collect calls into one Step RPC: ``with manager.batch() as b: b.free(r) ...``."""
        return StepBatcher(self)

    # -- KVCacheManager interface ------------------------------------------------------------
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlockIds, int]:
        """The longest prefix hit (a hint until adopted by allocate_slots)."""
        looked_up: tuple[KVCacheBlockIds, int] = self._now(self._ops.get_computed_blocks(request))
        return looked_up

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, return_table: bool = False) -> KVCacheBlockIds | None:  # fmt: skip
        """New block ids per group, or ``None`` when the pool has too few free blocks.

        With ``return_table`` the answer's ``table`` is the request's whole block table.
        """
        new: KVCacheBlockIds | None = self._now(self._item(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, return_table))  # fmt: skip
        return new

    def _item(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int,
              new_computed_blocks: KVCacheBlockIds | None, num_lookahead_tokens: int,
              num_external_computed_tokens: int, delay_cache_blocks: bool, num_encoder_tokens: int,
              return_table: bool) -> Item:  # fmt: skip
        """allocate_slots as an AllocateOp (a subclass adds its profile's fields here)."""
        return self._ops.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, return_table)  # fmt: skip

    def allocate_with_lookup(
        self,
        request: Any,
        max_num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]:
        """Look up and allocate atomically (the hit cannot go stale in between).

        Returns:
            ``(hit, hit_tokens, num_new_tokens, new_blocks)``: the adopted hit, the tokens
            scheduled (``min(remaining, max_num_new_tokens)``) and the new blocks, or
            ``None`` for them when the pool is out of blocks.
        """
        result: tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None] = self._now(
            self._ops.allocate_with_lookup(
                request,
                max_num_new_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
            )
        )
        return result

    def admit(
        self, requests: Sequence[Any], token_budget: int, num_lookahead_tokens: int = 0
    ) -> list[tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]]:
        """A scheduler's waiting loop, usually in one round trip: for each request in
        order, its prefix hit, then ``allocate_slots`` for ``min(remaining tokens, budget
        left)``, exactly as ``get_computed_blocks`` + ``allocate_slots`` one by one; stops
        when the budget is spent or after the first refusal.

        Requests are sent in chunks whose prompts cover the budget (a waiting queue's
        tail is not sent); only when prefix hits leave budget over is another chunk sent.

        Returns:
            ``(hit, hit_tokens, num_new_tokens, new_blocks)`` per request processed, in
            order; ``new_blocks`` is ``None`` for a last, refused one.
        """
        out: list[tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]] = []
        start, budget = 0, token_budget
        while start < len(requests) and budget > 0:
            end, covered = start, 0
            while end < len(requests) and covered < budget:
                covered += len(requests[end].all_token_ids) - int(requests[end].num_computed_tokens)
                end += 1
            chunk = requests[start:end]
            result: list[tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]] = self._now(
                self._ops.admit(chunk, budget, num_lookahead_tokens)
            )
            budget -= sum(n for _, _, n, new in result if new is not None)
            out.extend(result)
            if len(result) < len(chunk) or (result and result[-1][3] is None):
                break  # stopped by the budget or a refusal
            start = end
        return out

    def free(self, request: Any) -> None:
        """Free the request's blocks (sent with the next call)."""
        self.defer(self._ops.free(request))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self.defer(self._ops.cache_blocks(request, num_computed_tokens))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self.defer(self._ops.remove_skipped_blocks(request_id, total_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.defer(self._ops.evict_blocks(block_ids))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (null blocks as 0)."""
        ids: tuple[list[int], ...] = self._now(self._ops.get_block_ids(request_id))
        return ids

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        n: list[int] = self._now(self._ops.get_num_common_prefix_blocks(request_id))
        return n

    def reset_prefix_cache(self) -> bool:
        return bool(self._now(self._ops.reset_prefix_cache()))

    def take_events(self) -> list[pb.KVEvent]:
        """The pool's KV events since the previous call (this session's cursor)."""
        if not self.keeper.exclusive:
            self.send_items([], force=True)  # other sessions' calls make events too
        elif any(i.op.WhichOneof("op") not in _NO_EVENTS for i in self._queue):
            self.flush()  # queued calls that make events (cache_blocks stores blocks)
        for _ in range(MAX_EVENT_ROUNDS):
            if not self._events_more:
                break
            self.send_items([], force=True)  # an answer holds what fits below max_message_bytes
        events, self._events = self._events, []
        return events

    def make_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """This session's prefix-cache statistics since the previous call (None when the
        pool keeps none)."""
        if not self.log_stats:
            return None
        stats, self._stats = self._stats, pb.PrefixCacheStats()
        return stats

    def peek_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """What make_prefix_cache_stats would return, without resetting it."""
        if not self.log_stats:
            return None
        copy = pb.PrefixCacheStats()
        copy.CopyFrom(self._stats)
        return copy

    @property
    def usage(self) -> float:
        """The pool's usage as of the last answer, sending queued calls first."""
        if self._queue or self._usage is None:
            if self._queue:
                self.flush()
            else:
                self._usage = float(self.client.get_stats(self.pool).usage)
        assert self._usage is not None
        return self._usage

    def flush(self) -> None:
        """Send every queued call now."""
        if self._queue:
            self.send_items([])

    def close(self) -> None:
        """Send what is queued, then end the session (the server frees its requests)."""
        try:
            self.flush()
        finally:
            self.keeper.close()
            try:
                self.client.detach(self.session_id, self.keeper.fence)
            except (SessionExpiredError, FencedError):
                pass  # already gone: its requests were freed

    # -- sending ----------------------------------------------------------------------------
    def defer(self, item: Item | None) -> None:
        if item is not None:
            item.pending.resolver = self.flush
            self._queue.append(item)

    def _now(self, item: Item) -> Any:
        self.send_items([item])
        return item.pending.result()

    def send_items(self, items: list[Item], force: bool = False) -> None:
        """One Step with the queued calls, then ``items``; every Pending gets its answer.
        Without anything to send, nothing is sent unless ``force``.

        Raises:
            the error of a queued call nobody waited for (after every Pending is set).
        """
        items = self._queue + items
        self._queue = []
        if not items and not force:
            return
        keeper = self.keeper
        try:
            if self._reattach:  # the session was lost and re-attaching failed last time
                self.keeper.start_again()
                self._reattach = False
            keeper.vouch()
            sent = keeper.clock()
            self.round_trips += 1
            ops = [item.op for item in items]
            waited = time.perf_counter()
            try:
                resp = self.client.step(self.pool, ops, keeper.session_id, keeper.fence, include_state=True)
            finally:
                self.round_trip_seconds += time.perf_counter() - waited
            if keeper.clock() >= sent + keeper.lease * (1 - LEASE_MARGIN):
                raise LeaseExpiredError("the answer came after the session's lease could have ended")
        except KVCoordError as err:
            if isinstance(err, (SessionExpiredError, FencedError, LeaseExpiredError)):
                failure: KVCoordError = self._session_lost(err)  # its end frees everything
            else:
                if isinstance(err, (OutcomeUnknownError, AnswerEvictedError)) or any(
                    i.deferred and i.touched for i in items
                ):
                    # Applied or not, unknown; or not applied while queued calls in it
                    # (cache_blocks, remove_skipped_blocks) were already taken as done:
                    # none of its requests can be trusted.
                    failure = self._forget([rid for i in items for rid in i.touched], err)
                else:
                    self.tracker.rollback(_touched(items))
                    failure = err
                # Its queued frees may not have happened: free again (an unknown
                # request is already free).
                self._free_again(items)
            self._fail_all(items, failure)
            if not items or any(i.deferred for i in items):
                # Queued calls have no caller waiting to see this: the caller that sent
                # them (take_events, usage, flush, close, any other call) must.
                raise failure from None
            return
        keeper.renewed(sent)
        keeper.adopt(resp.fence)
        self._absorb(resp)
        failed: KVCoordError | None = None
        for item, result in zip(items, resp.results, strict=True):
            if result.status_code == 0:
                if not item.commits_itself:
                    self.tracker.commit(item.touched, item.marks)
                item.pending.set_result(item.decode(result))
                continue
            reason = pb.ErrorReason.Name(result.reason) if result.reason else ""
            op_err = error_from_code(status_code(result.status_code), result.status_message, "Step", reason)
            kind = item.op.WhichOneof("op")
            if isinstance(op_err, (SyncMismatchError, RequestUnknownError)) and item.touched:
                # The server holds another state than this client believed: the request
                # cannot be trusted any more.
                op_err = self._forget(item.touched, op_err)
            elif kind == "free" and item.deferred:
                # A queued free did not happen and nobody waits to see it: free the
                # request now, or its blocks stay held by a request the client forgot.
                self._free_now(item.op.free.request_id)
            item.pending.set_error(op_err)
            if item.deferred and failed is None:
                failed = op_err
        if any(r.status_code for r in resp.results):
            self.tracker.rollback(_touched(items))
        if failed is not None:
            raise failed

    def _absorb(self, resp: pb.StepResponse) -> None:
        """What every answer carries: usage, events, statistics."""
        self._usage = resp.usage
        if resp.events:
            self._events.extend(resp.events)
        self._events_more = resp.events_more
        if resp.HasField("prefix_cache_stats"):
            s, new = self._stats, resp.prefix_cache_stats
            for name in _STAT_FIELDS:
                setattr(s, name, getattr(s, name) + getattr(new, name))
            s.reset = s.reset or new.reset

    @staticmethod
    def _fail_all(items: list[Item], err: KVCoordError) -> None:
        for i in items:
            i.pending.set_error(err)

    # -- loss handling ------------------------------------------------------------------
    def _session_lost(self, err: KVCoordError) -> RequestsLostError:
        """Every tracked request is gone with the session: forget them and re-attach."""
        lost = self.tracker.clear()
        self.lost_requests += len(lost)
        try:
            self.keeper.start_again()
        except KVCoordError:  # e.g. unreachable, or the server's grace period: next call
            self._reattach = True
        return RequestsLostError(lost, err)

    def _free_now(self, request_id: str) -> None:
        """Free a request on the server at once. When the server cannot be reached, the
        free is queued for the next Step (its blocks must not stay held by a request
        nobody tracks); an unknown request is free already, a lost session's end frees
        everything it held, and a request of another session is not this one's to free
        (its id was taken after this session's request was gone). Any other refusal is
        logged and the free dropped: sent again it would fail every later Step."""
        try:
            self.client.free(self.pool, [request_id], session_id=self.session_id, fence=self.keeper.fence)
        except (RequestUnknownError, SessionExpiredError, FencedError, PermissionDeniedError):
            pass
        except _TRANSIENT:
            self._queue.append(self._ops.free_again(request_id))
        except KVCoordError as err:
            logger.error(
                "session %s could not free request %r, which may stay held until the session ends: %s",
                self.session_id, request_id, err,
            )  # fmt: skip

    def _free_again(self, items: Sequence[Item]) -> None:
        """The queued frees among ``items``, which may not have been applied."""
        for i in items:
            if i.op.WhichOneof("op") == "free":
                self._free_now(i.op.free.request_id)

    def _forget(self, request_ids: Sequence[str], err: KVCoordError) -> RequestsLostError:
        """These requests' server state is unknown: free them there (best effort) and here."""
        lost = self.tracker.forget(request_ids, lost=True)
        for rid in lost:
            self._free_now(rid)  # unknown there already, or freed
        self.lost_requests += len(lost)
        return RequestsLostError(lost, err)
