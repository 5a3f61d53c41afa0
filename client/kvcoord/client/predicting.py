"""vLLM's KVCacheManager methods answered at once from a mirror of an exclusive pool.

:class:`RemoteKVCacheManager` waits for the server whenever an answer needs it. This
manager never does: its session is the pool's only one, the server gives it the pool's
engine state when it attaches, and a :class:`~kvcoord.client.mirror.Mirror` (the
engine itself, loaded from that state) applies each call, so every answer is known in
the client, for every layout the engine knows. The calls still go to the server, in
order, as one Step per scheduler step sent from the
:class:`~kvcoord.client.sender.StepSender`'s background thread without waiting; the
server applies them (it stays the pool's owner: journal, metrics, events for others)
and checks what it can (hits answered ahead, promised allocations and refusals), and
the sender compares the rest (every new block id, free count, event and statistic) when the
answer comes. Events are compared unless the answer says ``events_gap``: the server's
event buffer wrapped (an eviction larger than it) and it kept only the newest, so they
are not comparable; that is no difference, and the rest is still compared.

A difference, a failed Step, a lost session or a lease the client cannot vouch for is
never absorbed: the next call raises :class:`RequestsLostError` naming every request
the session held (the manager ends the session, so the server frees them, and
attaches again with a fresh state). Until then, the worker used block ids from a
mirror that is consistent by construction (it never gives a held block to a second
request); what a difference shows is a server that disagrees with it, found at most
``max_backlog`` scheduler steps later.

A pool is refused (:class:`PredictionUnavailableError`, naming why) only when the server
gives no engine state or its engine's rules fingerprint differs from this client's
(another kvcoord release on one side): then the answers could differ, so the caller
runs without prediction. The same can happen mid-run, when a lost session is attached
again to a server restarted meanwhile with another engine (a rolling upgrade) or one
that has no state to give: every request is lost as for any loss, and
:attr:`PredictingKVCacheManager.on_unpredictable` (vLLM's adapter) takes over with a
session that waits for the server; without it the error is raised, naming why. A pool
created again with another configuration is refused for good (PoolChangedError).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import free_op

from .client import KVCoordClient
from .errors import InvalidArgumentError, KVCoordError
from .items import KVCacheBlockIds, put_admission
from .mirror import BlockIds, Mirror, MirrorUnavailableError, StaleCacheHitError
from .predicting_losses import PredictedLosses, PredictionUnavailableError
from .predicting_reports import PredictedReports
from .predicting_runs import NOT_TAKEN, PredictedRuns
from .sender import PredictionMismatchError, StepSender
from .session import SessionKeeper
from .tracking import SyncValues

__all__ = ["NOT_TAKEN", "PredictingKVCacheManager", "PredictionMismatchError", "PredictionUnavailableError"]

logger = logging.getLogger(__name__)


class PredictingKVCacheManager(PredictedRuns, PredictedLosses, PredictedReports):
    """vLLM KVCacheManager methods over an exclusive kvcoord pool, never waiting.

    Args:
        client: a connected :class:`KVCoordClient`.
        pool: the pool's name; no other session may be attached.
        hash_seed: the seed workers hash with; defaults to ``$PYTHONHASHSEED``.
        client_name: shown in server logs.
        lease_seconds: the session lease to ask for (0 = the server's default).
        renew: renew the lease on a background thread (turn off only in tests).
        max_backlog: scheduler steps (``take_events`` calls) whose calls may wait for
            the Step in flight before the manager waits for its answer: how late a
            difference may be found, and how far the client may run ahead.
        profile, num_hash_lookahead_tokens: the semantics profile the caller follows
            (``vllm-0.16`` when empty, or ``vllm-0.33``) and its look-ahead hash tokens,
            checked by the handshake (the mirror runs the pool's profile).
        reset_at_attach: the first Attach resets the pool's prefix cache (the caller's
            KV memory holds none of it: a new engine process). Every Attach after a loss
            resets it anyway: the worker may have written blocks the mirror handed out in
            Steps the server never applied and still caches under other hashes. A server
            that cannot reset at Attach is refused a mirror (PredictionUnavailableError).

    Raises:
        FailedPreconditionError: the pool has another session (PoolBusyError), or the
            server gives no state this client can mirror (PredictionUnavailableError,
            the reason in the message), or it was created again meanwhile with another
            configuration than get_pool said (PoolChangedError).
        RandomSeedError: caching is on and no seed is known.
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
        max_backlog: int = 8,
        profile: str = "",
        num_hash_lookahead_tokens: int = 0,
        reset_at_attach: bool = False,
    ) -> None:
        cfg, seed = self._open(client, pool, hash_seed)
        self._attach_args = (pool, cfg.hash_algo, cfg.hash_block_size, seed or "", client_name, lease_seconds)
        self._handshake = (profile, num_hash_lookahead_tokens)
        self.reset_at_attach, self._attached = reset_at_attach, False  # (an Attach after the first resets)
        self._mirror: Mirror | None = None
        self.keeper = SessionKeeper(client, self._attach, renew=renew)
        self.mirror: Mirror = self._loaded()
        #: sends the Steps (from its background thread), compares their answers with the
        #: mirror's, recovers lost requests
        self.sender = StepSender(client, pool, self.keeper, self.tracker, compare_events=cfg.enable_kv_cache_events,
                                 compare_stats=self.log_stats, max_backlog=max_backlog)  # fmt: skip
        #: the answer of every allocation that takes no block: one shared instance (its
        #: empty lists are not to be changed), which vLLM's adapter answers with vLLM's
        #: shared empty blocks
        self.no_blocks = KVCacheBlockIds(tuple([] for _ in cfg.groups))
        #: the engine's form of an empty hit (:meth:`lookup_ids`)
        self.no_hit: BlockIds = tuple(() for _ in cfg.groups)

    def _attach(self, previous: pb.Fence | None) -> pb.AttachResponse:
        """Attach exclusively and load the mirror from the answer's engine state
        (``previous``: the lost session's fence, SessionKeeper).

        Raises:
            PredictionUnavailableError: no state this client can mirror (the session the
                Attach made is ended); PoolChangedError: see :meth:`_attach_once` (the
                pool's rules are never mirrored from another's).
        """
        cfg = self.config
        reset = self.reset_at_attach or self._attached
        response = self._attach_once(
            *self._attach_args, True, True, want_engine_state=True, profile=self._handshake[0],
            num_hash_lookahead_tokens=self._handshake[1], reset_prefix_cache=reset, previous_fence=previous,
        )  # fmt: skip
        why = response.pool_state_unavailable or "the server sent no pool state"
        if reset and not response.prefix_cache_reset:
            why = "the server does not reset the prefix cache at Attach (a release before reset_prefix_cache)"
        elif response.HasField("pool_state"):
            try:
                self._mirror = Mirror(cfg, response.pool_state)
            except MirrorUnavailableError as err:
                why = str(err)
            else:
                self._attached = True
                return response
        self._unused(response, PredictionUnavailableError(self.pool, why))

    def _loaded(self) -> Mirror:
        """The mirror the last Attach loaded."""
        mirror, self._mirror = self._mirror, None
        assert mirror is not None, "attached without a mirror"
        mirror.convert = self.event_converter
        return mirror

    # -- KVCacheManager interface ------------------------------------------------------------
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlockIds, int]:
        """The longest prefix hit, answered now (the server checks it)."""
        block_ids, num_tokens = self.lookup_ids(request)
        return KVCacheBlockIds(tuple([list(g) for g in block_ids])), num_tokens

    def lookup_ids(self, request: Any) -> tuple[BlockIds, int]:
        """:meth:`get_computed_blocks`'s hit as the engine's block id tuples per group
        (not to be changed: vLLM's adapter reads them in place) and its token count."""
        self._settled()
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.no_hit, 0
        op, sync, back = self._synced(request)
        try:
            block_ids, num_tokens = self.mirror.lookup(sync.request_id)
        except BaseException:  # nothing of the call is kept or sent
            back()
            raise

        def write() -> None:
            lookup = op.lookup
            sync.write(lookup.request)
            answered = lookup.answered
            for group in block_ids:
                answered.groups.add().block_ids.extend(group)
            answered.num_tokens = num_tokens

        self.sender.later(write)
        return block_ids, num_tokens

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, return_table: bool = False) -> KVCacheBlockIds | None:  # fmt: skip
        """New block ids, or ``None`` when the pool has too few free blocks, answered now
        (with ``return_table``, the answer's ``table`` is the request's whole table;
        vLLM 0.33's inputs, for a ``vllm-0.33`` pool: :attr:`admission`)."""
        new: object = NOT_TAKEN
        if not (
            num_new_computed_tokens or num_external_computed_tokens or delay_cache_blocks or num_encoder_tokens
        ):  # fmt: skip
            new = self.allocate_running(request, num_new_tokens, num_lookahead_tokens)  # (it reads admission)
        if new is NOT_TAKEN:
            if self.sender.failure is not None:
                self._settled()
            keeper = self.keeper
            if keeper.lost is not None or keeper.clock() >= keeper.valid_until:
                self._vouch()
            new = self._allocate(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                 num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                                 num_encoder_tokens)  # fmt: skip
        if new is None:
            return None
        assert isinstance(new, tuple)
        if not return_table:
            return KVCacheBlockIds(tuple([list(g) for g in new])) if any(new) else self.no_blocks
        return KVCacheBlockIds(tuple([list(g) for g in new]), table=self.mirror.table(request.request_id))

    def _allocate(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int,
                  new_computed_blocks: KVCacheBlockIds | None, num_lookahead_tokens: int,
                  num_external_computed_tokens: int, delay_cache_blocks: bool,
                  num_encoder_tokens: int) -> BlockIds | None:  # fmt: skip
        """allocate_slots for a new request, a hit, a KV connector's or encoder's tokens,
        vLLM 0.33's admission inputs, or bad input (the mirror's engine names it, and
        nothing is sent)."""
        rid = request.request_id
        hit: tuple[tuple[int, ...], ...] | None = None
        if new_computed_blocks is not None and num_new_computed_tokens:
            hit = tuple(tuple(g) for g in new_computed_blocks.block_ids)
        mirror = self.mirror
        op, sync, back = self._synced(request)
        a = op.allocate
        self.sender.later(lambda: sync.write(a.request))
        a.num_new_tokens = num_new_tokens
        a.num_lookahead_tokens = num_lookahead_tokens
        a.num_external_computed_tokens = num_external_computed_tokens
        a.delay_cache_blocks = delay_cache_blocks
        a.num_encoder_tokens = num_encoder_tokens
        admission = self.admission
        put_admission(a, admission)
        if hit is not None:
            a.num_new_computed_tokens = num_new_computed_tokens
            for group in hit:
                a.new_computed_blocks.groups.add().block_ids.extend(group)
            a.new_computed_blocks.num_tokens = num_new_computed_tokens
        try:
            new = mirror.allocate(
                rid, num_new_tokens, num_new_computed_tokens if hit is not None else 0,
                hit, num_lookahead_tokens,
                num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, *admission,
            )  # fmt: skip
        except StaleCacheHitError:
            # as the server answers a stale hit: refused, nothing changed (its sync undone)
            back()
            self.stale_hits += 1
            return None
        except BaseException:
            back()
            raise
        if new is None:
            a.must_refuse = True
            return None
        a.must_succeed = True
        self.sender.expect("new", new)
        return new

    def free(self, request: Any, uncomputed_from: int | None = None) -> None:
        """Free the request's blocks (sent with the next Step). ``uncomputed_from``: an
        undone step's free (``FreeOp.uncomputed_from``): the cache entries of its blocks
        holding any position at or past that token are dropped first, in the mirror too."""
        rid = request if isinstance(request, str) else request.request_id
        tracker = self.tracker
        if tracker.lost:
            tracker.lost.discard(rid)  # a lost request the scheduler frees is settled
        tracked = tracker.take(rid)
        if tracked is None:
            return  # never sent (or lost with its session): nothing to free
        record = self.mirror.free_if_held(rid, uncomputed_from)
        sender = self.sender
        free_op(rid, uncomputed_from=uncomputed_from, into=sender.op().free)
        # (deallocated with the Step on the sender thread, while the model runs)
        sender.pending.dropped += (tracked, record)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (``RequestUnknownError`` for a request the
        pool does not hold, as the server answers)."""
        return self.mirror.table(request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks attention no longer reads (sliding window, chunked local,
        mamba); nothing is sent when the engine would free none."""
        self._settled()
        mirror = self.mirror
        if request_id not in self.tracker or not mirror.holds(request_id):
            return
        if not mirror.skips_blocks(request_id, total_computed_tokens):
            return
        mirror.call("remove_skipped_blocks", request_id, total_computed_tokens)
        op = self.sender.op().remove_skipped_blocks
        op.request.CopyFrom(self.tracker.position(request_id))
        op.total_computed_tokens = total_computed_tokens

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, the request's leading blocks shared by every request holding blocks."""
        sender = self.sender
        if sender.failure is not None:  # (_settled's first test: every step's call)
            self._settled()
        n = self.mirror.common_prefix(request_id) if request_id in self.tracker else None
        if n is None:
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id!r} is not in this pool"
            )
        sender.op().common_prefix.request_id = request_id
        sender.expect("common_prefix", n)
        return n

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the cached hash of each block, in the caller's order."""
        self._settled()
        ids = [int(b) for b in block_ids]
        self.mirror.call("evict_blocks", ids)
        self.sender.op().evict_blocks.block_ids.extend(ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (nothing changed) while any block is held."""
        self._settled()
        done = bool(self.mirror.call("reset_prefix_cache"))
        self.sender.op().reset_prefix_cache.SetInParent()
        self.sender.expect("reset", done)
        return done

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the request's blocks full within ``num_computed_tokens`` (vLLM's
        AsyncScheduler calls it every step; nothing is sent when no block became full)."""
        if not self.enable_caching:
            return
        self._settled()
        if not 0 <= num_computed_tokens <= len(request.all_token_ids):
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_computed_tokens {num_computed_tokens} is past the request's {len(request.all_token_ids)} tokens",
            )
        rid = request.request_id
        mirror = self.mirror
        if (
            rid not in self.tracker
            or not mirror.holds(rid)
            or not mirror.caches_more(rid, num_computed_tokens)
        ):
            return
        op, sync, back = self._synced(request)
        cache = op.cache_blocks
        cache.num_computed_tokens = num_computed_tokens
        self.sender.later(lambda: sync.write(cache.request))
        try:
            mirror.call("cache_blocks", rid, num_computed_tokens)
        except BaseException:
            back()
            raise

    def flush(self) -> None:
        """Send every call and wait until the server confirmed every answer.

        Raises:
            RequestsLostError: an answer differed or a Step failed.
        """
        self._cut(wait=True)
        self.sender.settle()
        self._settled()

    def close(self) -> None:
        """Send what is queued, then end the session (the server frees its requests)."""
        try:
            self.flush()
        finally:
            self.sender.close()
            self.keeper.close()
            try:
                self.client.detach(self.session_id, self.keeper.fence)
            except KVCoordError:
                pass  # already gone: its requests were freed

    # -- sending ----------------------------------------------------------------------------
    def _synced(self, request: Any) -> tuple[pb.Operation, SyncValues, Callable[[], None]]:
        """Begin an operation carrying the request's sync and apply the sync to the
        mirror: the operation (its sync is written on the sender thread, see
        :meth:`StepSender.later`), the sync, and how to take the call back when the
        mirror refuses it (the sync undone in the mirror, the operation taken back, the
        request's position restored). When the tracker or the mirror refuses the sync
        itself (a lost request used again, another request under a tracked id, bad
        values), the operation is taken back here, so the Step sent next holds only
        whole operations."""
        rid = request.request_id
        mark = self.tracker.mark(rid)
        op = self.sender.op()
        try:
            sync = self.tracker.sync_values(request)
        except BaseException:
            self.sender.take_back()
            raise
        self.sender.grew(len(sync.tokens), len(sync.hashes))
        try:
            undo = self.mirror.apply(sync)
        except BaseException:
            self._take_back(rid, mark)
            raise

        def back() -> None:
            undo()
            self._take_back(rid, mark)

        return op, sync, back

    def _take_back(self, request_id: str, mark: tuple[int, int, int, bool] | None) -> None:
        """Take back the operation just begun (the mirror refused it): nothing of it is
        sent, and the request's position is where it was before it."""
        self.sender.take_back()
        self.tracker.restore({request_id: mark})

    def _cut(self, wait: bool = False) -> None:
        """End a scheduler step: its calls go to the server (or join the next Step
        while one is in flight); a failure found meanwhile is reported."""
        sender = self.sender
        # (what the answer to the Step sent now must say: the mirror's free count, events
        # and statistics, read by the sender when it hands the Step over)
        sender.cut(self.mirror.take_step, wait)
        if sender.failure is not None:  # (_settled's first test: every step's end)
            self._settled()
