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
usually cost nothing. With ``exclusive=True`` (the session is the pool's only one, as
for one vLLM engine per pool) the manager knows the pool's free blocks exactly and
answers an ``allocate_slots`` it can prove will succeed at once; its block ids arrive
with the next Step (reading them sends it). A scheduler step then costs one round
trip plus one per prefix lookup of a newly admitted request.

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

import os
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from kvcoord.v1 import allocator_pb2 as pb

from .batch import Item, KVCacheBlockIds, Ops, Pending, StepBatcher
from .client import KVCoordClient
from .errors import (
    AnswerEvictedError,
    FencedError,
    KVCoordError,
    LeaseExpiredError,
    OutcomeUnknownError,
    RequestsLostError,
    RequestUnknownError,
    SessionExpiredError,
    SyncMismatchError,
    error_from_code,
    status_code,
)
from .hashing import RandomSeedError, none_hash
from .promises import BlockBudget
from .session import LEASE_MARGIN, SessionKeeper
from .tracking import RequestTracker

__all__ = ["KVCacheBlockIds", "Pending", "RemoteKVCacheManager", "StepBatcher"]

T = TypeVar("T")

_STAT_FIELDS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")


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
        exclusive: be the pool's only session, and answer provable allocations at once.

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
    ) -> None:
        self.client = client
        self.pool = pool
        info = client.get_pool(pool).pool
        cfg = info.config
        self.config = cfg
        self.enable_caching = cfg.enable_caching
        seed = hash_seed if hash_seed is not None else os.environ.get("PYTHONHASHSEED")
        none = b""
        if self.enable_caching:
            if seed is None:
                raise RandomSeedError(
                    "no hash seed: set PYTHONHASHSEED (or pass hash_seed) to the value the vLLM workers use"
                )
            none = none_hash(cfg.hash_algo, seed)
        self.tracker = RequestTracker(cfg, none)
        self.exclusive = exclusive
        self.keeper = SessionKeeper(
            client,
            lambda: client.attach(
                pool, cfg.hash_algo, cfg.hash_block_size, seed or "", client_name, lease_seconds, exclusive
            ),
            renew=renew,
        )
        self.num_groups = len(cfg.groups)
        self.log_stats = cfg.log_stats if cfg.HasField("log_stats") else True
        self._ops = Ops(self)
        self.budget = BlockBudget(cfg.groups, cfg.max_model_len)
        #: calls sent with the next Step (frees, cache_blocks, promised allocations)
        self._queue: list[Item] = []
        #: with exclusive: free blocks as of the last answer, less what promises may take
        self._free_estimate: int | None = None
        self._usage: float | None = None
        self._events: list[pb.KVEvent] = []
        self._stats = pb.PrefixCacheStats()
        self._reattach = False
        #: allocate_slots calls answered None because the hit had gone stale (another
        #: worker reused its blocks after the lookup); the scheduler looks up again.
        self.stale_hits = 0
        #: requests reported lost (RequestsLostError) since the manager was created
        self.lost_requests = 0
        #: Step round trips sent, and allocations answered without one
        self.round_trips = 0
        self.promised = 0

    @property
    def session_id(self) -> str:
        return self.keeper.session_id

    def batch(self) -> StepBatcher:
        """Collect calls into one Step RPC: ``with manager.batch() as b: b.free(r) ...``."""
        return StepBatcher(self)

    # -- KVCacheManager interface ------------------------------------------------------------
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlockIds, int]:
        """The longest prefix hit (a hint until adopted by allocate_slots)."""
        hit: tuple[KVCacheBlockIds, int] = self._now(self._ops.get_computed_blocks(request))
        return hit

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, return_table: bool = False) -> KVCacheBlockIds | None:  # fmt: skip
        """New block ids per group, or ``None`` when the pool has too few free blocks.

        With ``return_table`` the answer's ``table`` is the request's whole block table.
        """
        item = self._ops.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, return_table)  # fmt: skip
        rid = request.request_id
        hit = new_computed_blocks.block_ids if new_computed_blocks is not None else None
        need, before, after = self.budget.bound(
            rid, int(request.num_computed_tokens), num_new_tokens, num_new_computed_tokens, hit,
            num_lookahead_tokens, num_external_computed_tokens, num_encoder_tokens)  # fmt: skip
        if before is not None and after is not None:
            self._verify_lengths(item, rid, before, after)
        keeper = self.keeper
        if (
            self._free_estimate is not None
            and need <= self._free_estimate
            and keeper.lost is None
            and keeper.clock() < keeper.valid_until
        ):
            # Provably enough free blocks (this session is the pool's only one):
            # answer now, send with the next Step.
            self._free_estimate -= need
            item.op.allocate.must_succeed = True
            item.pending._resolve = self.flush
            item.deferred = True  # its caller has its answer: a failure is raised by the sender
            self._queue.append(item)
            self.budget.applied(rid, after)
            self.promised += 1
            return KVCacheBlockIds(pending=item.pending)
        new: KVCacheBlockIds | None = self._now(item)
        if new is not None:
            self.budget.applied(rid, after)
        return new

    def _verify_lengths(self, item: Item, rid: str, before: list[int], after: list[int]) -> None:
        """Check, when the answer comes, that it took the blocks the bound expected."""
        decode, budget = item.decode, self.budget

        def checked(r: pb.OperationResult) -> Any:
            value = decode(r)
            if isinstance(value, KVCacheBlockIds):
                budget.verify(rid, before, after, value.block_ids)
            return value

        item.decode = checked

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
            for request, (hit, hit_tokens, n, new) in zip(chunk, result, strict=False):
                if new is not None:  # its table lengths from now on: the hit, then what it took
                    _, _, after = self.budget.bound(
                        request.request_id, 0, n, hit_tokens, hit.block_ids, num_lookahead_tokens
                    )
                    self.budget.applied(request.request_id, after)
                    budget -= n
            out.extend(result)
            if len(result) < len(chunk) or (result and result[-1][3] is None):
                break  # stopped by the budget or a refusal
            start = end
        return out

    def free(self, request: Any) -> None:
        """Free the request's blocks (sent with the next call)."""
        rid = request if isinstance(request, str) else request.request_id
        self.tracker.lost.discard(rid)  # vLLM frees finished and preempted requests alike
        self._defer(self._ops.free(request))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._defer(self._ops.cache_blocks(request, num_computed_tokens))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self._defer(self._ops.remove_skipped_blocks(request_id, total_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._defer(self._ops.evict_blocks(block_ids))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
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
            self._send([], force=True)  # other sessions' calls make events too
        elif any(i.op.WhichOneof("op") not in ("free", "remove_skipped_blocks") for i in self._queue):
            self.flush()  # queued calls that make events (allocations and cache_blocks store blocks)
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
        """The pool's usage (sends queued calls first, so it is exact)."""
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
            self._send([])

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
    def _defer(self, item: Item | None) -> None:
        if item is not None:
            item.pending._resolve = self.flush
            self._queue.append(item)

    def _now(self, item: Item) -> Any:
        self._send([item])
        return item.pending.result()

    def _send(self, items: list[Item], force: bool = False) -> None:
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
                self._attach_again()
                self._reattach = False
            keeper.vouch()
            sent = keeper.clock()
            self.round_trips += 1
            resp = self.client.step(
                self.pool, [i.op for i in items], keeper.session_id, keeper.fence, include_state=True
            )
            if keeper.clock() >= sent + keeper.lease * (1 - LEASE_MARGIN):
                raise LeaseExpiredError("the answer came after the session's lease could have ended")
        except KVCoordError as err:
            if isinstance(err, (SessionExpiredError, FencedError, LeaseExpiredError)):
                failure: KVCoordError = self._session_lost(err)
            elif isinstance(err, (OutcomeUnknownError, AnswerEvictedError)):
                failure = self._forget([rid for i in items for rid in i.touched], err)
            else:
                self.tracker.rollback()
                failure = err
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
                    self.tracker.commit(item.touched)
                item.pending._set(item.decode(result))
                continue
            reason = pb.ErrorReason.Name(result.reason) if result.reason else ""
            op_err = error_from_code(status_code(result.status_code), result.status_message, "Step", reason)
            if reason == "PREDICTION_FAILED":
                # A promise was broken: nothing in this Step can be trusted.
                lost = self._forget([rid for i in items for rid in i.touched], op_err)
                for rest in items:
                    if not rest.pending.done:
                        rest.pending._fail(lost)
                failed = failed or lost
                break
            kind = item.op.WhichOneof("op")
            promised = kind == "allocate" and item.op.allocate.must_succeed
            if (promised or isinstance(op_err, (SyncMismatchError, RequestUnknownError))) and item.touched:
                # The server holds another state than this client believed (or than it
                # already told its caller): the request cannot be trusted any more.
                op_err = self._forget(item.touched, op_err)
            elif kind == "free" and item.deferred:
                # A queued free did not happen and nobody waits to see it: free the
                # request now, or its blocks stay held by a request the client forgot.
                self._free_now(item.op.free.request_id)
            item.pending._fail(op_err)
            if item.deferred and failed is None:
                failed = op_err
        if any(r.status_code for r in resp.results):
            self.tracker.rollback()
        if failed is not None:
            raise failed

    def _absorb(self, resp: pb.StepResponse) -> None:
        """What every answer carries: usage, free blocks, events, statistics."""
        self._usage = resp.usage
        if self.exclusive and self.keeper.exclusive:
            self._free_estimate = resp.num_free_blocks
        if resp.events:
            self._events.extend(resp.events)
        if resp.HasField("prefix_cache_stats"):
            s, new = self._stats, resp.prefix_cache_stats
            for name in _STAT_FIELDS:
                setattr(s, name, getattr(s, name) + getattr(new, name))
            s.reset = s.reset or new.reset

    @staticmethod
    def _fail_all(items: list[Item], err: KVCoordError) -> None:
        for i in items:
            i.pending._fail(err)

    # -- loss handling ------------------------------------------------------------------
    def _session_lost(self, err: KVCoordError) -> RequestsLostError:
        """Every tracked request is gone with the session: forget them and re-attach."""
        lost = self.tracker.clear()
        self.budget.clear()
        self.lost_requests += len(lost)
        self._free_estimate = None
        try:
            self._attach_again()
        except KVCoordError:  # e.g. unreachable, or the server's grace period: next call
            self._reattach = True
        return RequestsLostError(lost, err)

    def _attach_again(self) -> None:
        """A new session after the old one was lost. The server may still hold the old
        one (only this client gave up on its lease): end it first, so its requests are
        freed now and an exclusive session can be taken again at once."""
        try:
            self.client.detach(self.keeper.session_id, self.keeper.fence)
        except KVCoordError:
            pass  # already gone, or unreachable (then its lease ends it)
        self.keeper.attach()

    def _free_now(self, request_id: str) -> None:
        """Free a request on the server at once (best effort: if the session is gone,
        its lease frees it anyway)."""
        try:
            self.client.free(self.pool, [request_id], session_id=self.session_id, fence=self.keeper.fence)
        except KVCoordError:
            pass

    def _forget(self, request_ids: Sequence[str], err: KVCoordError) -> RequestsLostError:
        """These requests' server state is unknown: free them there (best effort) and here."""
        lost = self.tracker.forget(request_ids, lost=True)
        for rid in request_ids:
            self.budget.forget(rid)
        self._free_estimate = None  # re-learned from the next answer
        for rid in lost:
            self._free_now(rid)  # unknown there already, or freed
        self.lost_requests += len(lost)
        return RequestsLostError(lost, err)
