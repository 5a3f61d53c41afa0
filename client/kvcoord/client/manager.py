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
scheduler can preempt and recompute them; the next call works normally. Sending,
answer dispatch and that recovery are the :class:`~kvcoord.client.sender.StepSender`'s
(the one sender of both modes); this class is the vLLM-facing facade only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from .batch import Admitted, Ops, StepBatcher
from .client import KVCoordClient
from .errors import FencedError, PoolBusyError, SessionExpiredError
from .items import Item, KVCacheBlockIds, Pending, no_answer
from .sender import StepSender
from .session import SessionKeeper
from .session_facts import SessionFacts

__all__ = ["KVCacheBlockIds", "Pending", "RemoteKVCacheManager", "StepBatcher"]

T = TypeVar("T")

#: empty Steps take_events sends at most to fetch events the server cut from answers
#: (StepResponse.events_more); each answer carries up to max_message_bytes of them
MAX_EVENT_ROUNDS = 64


#: queued operations that make no KV events (nor does a run of checks alone)
_NO_EVENTS = ("free", "remove_skipped_blocks", "lookup", "get_block_ids")


class RemoteKVCacheManager(SessionFacts):
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
        reset_at_attach: every Attach (the first, and each after a loss) resets the
            pool's prefix cache with the session's start (refused, PoolBusyError, while
            another session is attached): the caller's KV memory holds none of what the
            pool caches (a new engine process) or may hold other KV (a call cut by the
            loss cached blocks whose KV was never computed). A server that does not
            reset at Attach (an older release) is sent ResetPrefixCache at once instead.
        clock: the monotonic seconds the session's lease is counted in (tests share a
            ManualClock with an in-process server; the renewals still come every third
            of a lease of real time).

    Raises:
        RandomSeedError: caching is on and no seed is known.
        HashMismatchError: the pool hashes differently.
        FailedPreconditionError: ``exclusive`` and the pool has another session; or
            PoolChangedError, at any later Attach too (after a loss): the pool was
            created again with another configuration than get_pool said.
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
        reset_at_attach: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cfg, seed = self._open(client, pool, hash_seed)
        self.exclusive = exclusive
        reset = reset_at_attach

        def attach(previous: pb.Fence | None) -> pb.AttachResponse:
            # the semantics profile the caller follows is part of the handshake ("": vllm-0.16)
            response = self._attach_once(
                pool, cfg.hash_algo, cfg.hash_block_size, seed or "", client_name, lease_seconds, exclusive,
                profile=profile, num_hash_lookahead_tokens=num_hash_lookahead_tokens, reset_prefix_cache=reset,
                previous_fence=previous,
            )  # fmt: skip
            if reset and not response.prefix_cache_reset:
                self._reset_after_attach(response)
            return response

        self.keeper = SessionKeeper(client, attach, clock=clock, renew=renew)
        #: sends the Steps (inline), dispatches their answers, recovers lost requests
        self.sender = StepSender(client, pool, self.keeper, self.tracker)
        self._ops = Ops(self)

    def _reset_after_attach(self, response: pb.AttachResponse) -> None:
        """Reset the prefix cache of an exclusive session just attached to a server that
        did not reset it with the Attach (a release before AttachRequest.reset_prefix_cache):
        no call of the session has read the cache yet.

        Raises:
            PoolBusyError: a block is held, so the cache could not be reset (the session is
                ended first: its engine must not read the cache).
        """
        if self.client.reset_prefix_cache(self.pool, response.session_id, response.fence).result:
            return
        self._unused(response, PoolBusyError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pool {self.pool!r} holds blocks, so its prefix cache could not be reset for this engine; attach "
            "once they are freed",
            "POOL_EXCLUSIVE",
        ))  # fmt: skip

    @property
    def round_trips(self) -> int:
        """Step round trips sent."""
        return self.sender.steps_sent

    @property
    def round_trip_seconds(self) -> float:
        """The seconds spent waiting on Steps (from sending the request to holding the answer)."""
        return self.sender.waited_seconds

    def batch(self) -> StepBatcher:
        """Collect calls into one Step RPC: ``with manager.batch() as b: b.free(r) ...``."""
        return StepBatcher(self)

    # -- KVCacheManager interface ------------------------------------------------------------
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlockIds, int]:
        """The longest prefix hit (a hint until adopted by allocate_slots)."""
        return self._now(self._ops.get_computed_blocks(request))

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, return_table: bool = False) -> KVCacheBlockIds | None:  # fmt: skip
        """New block ids per group, or ``None`` when the pool has too few free blocks.

        With ``return_table`` the answer's ``table`` is the request's whole block table.
        """
        return self._now(self._ops.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, return_table))  # fmt: skip

    def allocate_with_lookup(
        self,
        request: Any,
        max_num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> Admitted:
        """Look up and allocate atomically (the hit cannot go stale in between).

        Returns:
            ``(hit, hit_tokens, num_new_tokens, new_blocks)``: the adopted hit, the tokens
            scheduled (``min(remaining, max_num_new_tokens)``) and the new blocks, or
            ``None`` for them when the pool is out of blocks.
        """
        return self._now(self._ops.allocate_with_lookup(
            request, max_num_new_tokens, num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens))  # fmt: skip

    def admit(
        self, requests: Sequence[Any], token_budget: int, num_lookahead_tokens: int = 0
    ) -> list[Admitted]:
        """A scheduler's waiting loop, usually in one round trip: for each request in
        order, its prefix hit, then ``allocate_slots`` for ``min(remaining tokens, budget
        left)``, exactly as ``get_computed_blocks`` + ``allocate_slots`` one by one; stops
        when the budget is spent or after the first refusal.

        Requests are sent in chunks whose prompts cover the budget (a waiting queue's
        tail is not sent); only when prefix hits leave budget over is another chunk sent.
        A chunk holds at most the server's max_ops_per_step requests (an AdmitOp naming
        more is refused whole, INVALID_ARGUMENT, at every step as long).

        Returns:
            ``(hit, hit_tokens, num_new_tokens, new_blocks)`` per request processed, in
            order; ``new_blocks`` is ``None`` for a last, refused one.
        """
        out: list[Admitted] = []
        start, budget = 0, token_budget
        cap = self.client.step_piece_ops or len(requests)  # (0: a server before the field)
        while start < len(requests) and budget > 0:
            end, covered = start, 0
            while end < len(requests) and covered < budget and end - start < cap:
                covered += len(requests[end].all_token_ids) - int(requests[end].num_computed_tokens)
                end += 1
            chunk = requests[start:end]
            result = self._now(self._ops.admit(chunk, budget, num_lookahead_tokens))
            budget -= sum(n for _, _, n, new in result if new is not None)
            out.extend(result)
            if len(result) < len(chunk) or (result and result[-1][3] is None):
                break  # stopped by the budget or a refusal
            start = end
        return out

    def free(self, request: Any, uncomputed_from: int | None = None) -> None:
        """Free the request's blocks (sent with the next call). ``uncomputed_from``: an
        undone step's free (``FreeOp.uncomputed_from``): the cache entries of its blocks
        holding any position at or past that token are dropped first."""
        self.defer(self._ops.free(request, uncomputed_from))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self.defer(self._ops.cache_blocks(request, num_computed_tokens))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self.defer(self._ops.remove_skipped_blocks(request_id, total_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.defer(self._ops.evict_blocks(block_ids))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (null blocks as 0)."""
        return self._now(self._ops.get_block_ids(request_id))

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return self._now(self._ops.get_num_common_prefix_blocks(request_id))

    def reset_prefix_cache(self) -> bool:
        return self._now(self._ops.reset_prefix_cache())

    def take_events(self) -> list[pb.KVEvent]:
        """The pool's KV events since the previous call (this session's cursor)."""
        sender = self.sender
        if not self.keeper.exclusive:
            sender.send_items([], force=True)  # other sessions' calls make events too
        elif any(i.op.WhichOneof("op") not in _NO_EVENTS for i in sender.queue):
            sender.flush()  # queued calls that make events (cache_blocks stores blocks)
        for _ in range(MAX_EVENT_ROUNDS):
            if not sender.events_more:
                break
            sender.send_items([], force=True)  # an answer holds what fits below max_message_bytes
        events, sender.events = sender.events, []
        return events

    def make_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """This session's prefix-cache statistics since the previous call (None when the
        pool keeps none): :meth:`peek_prefix_cache_stats`'s, then reset."""
        stats = self.peek_prefix_cache_stats()
        self.sender.stats = pb.PrefixCacheStats()
        return stats

    def peek_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """What make_prefix_cache_stats would return, without resetting it."""
        if not self.log_stats:
            return None
        copy = pb.PrefixCacheStats()
        copy.CopyFrom(self.sender.stats)
        return copy

    @property
    def usage(self) -> float:
        """The pool's usage as of the last answer, sending queued calls first."""
        sender = self.sender
        if sender.queue:
            sender.flush()
        elif sender.usage is None:
            sender.usage = float(self.client.get_stats(self.pool).usage)
        assert sender.usage is not None
        return sender.usage

    def flush(self) -> None:
        """Send every queued call now."""
        self.sender.flush()

    def close(self) -> None:
        """Send what is queued, then end the session (the server frees the requests it
        still holds as abandoned: the cache entries of blocks only they held are dropped;
        free finished requests first to keep them cached)."""
        try:
            self.flush()
        finally:
            self.keeper.close()
            try:
                self.client.detach(self.session_id, self.keeper.fence)
            except (SessionExpiredError, FencedError):
                pass  # already gone: its requests were freed

    # -- sending (the sender's; these serve subclasses with calls of their own) ---------------
    def defer(self, item: Item[Any] | None) -> None:
        """Send ``item`` with the next Step."""
        self.sender.defer(item)

    def defer_op(self, op: pb.Operation) -> None:
        """Send ``op``, whose answer says nothing, with the next Step."""
        self.sender.defer(Item(op, no_answer, deferred=True))

    def _now(self, item: Item[T]) -> T:
        return self.sender.now(item)
