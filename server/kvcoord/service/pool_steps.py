"""A pool's Step: operations applied in order for a session, stopping at the first
failure, at once or in slices (the pool held meanwhile: pool_locks.py); each operation
answered by its handler here, or by pool_allocations.py's for the allocating ones.
A part of :class:`~.pool_service.PoolService` (its ``steps``), reached through it."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from kvcoord.engine import HintMismatchError

from . import operations as op
from .errors import ErrorReason, ServiceError, Status, as_service_error
from .pool_allocations import ALLOCATE_SLICE_BLOCKS, DECODE_SLICE_ENTRIES, PoolAllocations
from .pool_core import PoolCore
from .pool_events import PoolEvents
from .pool_requests import RequestSyncs
from .pool_types import drain
from .sessions import Session

#: free-queue positions a hint lookup walks by default, and at most
DEFAULT_WALK_LIMIT = 4096
MAX_WALK_LIMIT = 1 << 16

#: an operation's handler: the session and the operation (of the type it is filed under)
Handler = Callable[[Session, Any], op.Value]


class StepRunner:
    """The Step operations of one pool."""

    def __init__(
        self, pool: PoolCore, syncs: RequestSyncs, allocations: PoolAllocations, event_feed: PoolEvents
    ) -> None:
        self.pool = pool
        self.syncs = syncs
        self.allocations = allocations
        self.event_feed = event_feed
        a = allocations
        #: each operation's handler, by its type
        self.handlers: dict[type, Handler] = {
            op.Lookup: self._lookup,
            op.Allocate: a.allocate_adopting,
            op.Free: self._free,
            op.Preempt: self._preempt,
            op.CacheBlocks: self._cache_blocks,
            op.RemoveSkipped: self._remove_skipped,
            op.EvictBlocks: self._evict,
            op.GetBlockIds: self._get_block_ids,
            op.CommonPrefix: self._common_prefix,
            op.ResetPrefixCache: self._reset,
            op.TakeEvents: self._take_events,
            op.MakeStats: self._make_stats,
            op.Sync: self._sync,
            op.Admit: a.admit_adopting,
            op.AllocateRun: a.allocate_run,
            op.Decode: a.decode,
            op.RecordStats: self._record_stats,
            op.EstimateCachedTokens: self._estimate_cached_tokens,
            op.NewStepStarts: self._new_step_starts,
            op.GetNumBlocksToAllocate: self._num_blocks_to_allocate,
            op.TakeNewBlockIds: self._take_new_block_ids,
            op.TakeBoundaryStateOffloads: self._take_offloads,
            op.TakeBlockCopies: self._take_copies,
            op.ReleaseRetained: self._release_retained,
            op.DropOffloads: self._drop_offloads,
            op.RecordForZeroing: self._record_for_zeroing,
            op.DropUncomputed: self._drop_uncomputed,
        }

    def apply(self, s: Session, ops: Sequence[op.Operation]) -> list[op.Outcome]:
        """Apply ``ops`` in order for session ``s``; after the first failure the rest
        are not applied (``aborted_by`` names the failed one). Earlier ones stay.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED when there are too many operations.
        """
        return drain(self.applying(s, ops))

    def applying(
        self, s: Session, ops: Sequence[op.Operation], every: int = 0
    ) -> Generator[None, None, list[op.Outcome]]:
        """:meth:`apply` in slices: a generator that yields after every ``every``
        operations (0: never) and returns the outcomes. Its caller may serve other
        pools between slices, but nothing may touch this pool until it returns (the
        session's statistics are swapped into the engine meanwhile; pool_locks.py).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED when there are too many operations.
        """
        self.check_step_size(len(ops))
        engine = self.pool.engine
        shared_stats = engine.prefix_cache_stats
        if shared_stats is not None:
            engine.prefix_cache_stats = s.stats
        handlers = self.handlers
        out: list[op.Outcome] = []
        failed = -1
        try:
            for i, o in enumerate(ops):
                if failed >= 0:
                    out.append(op.Outcome(aborted_by=failed))
                    continue
                if every and i and not i % every:
                    yield
                try:
                    if every and type(o) is op.Allocate and self.allocations.sliceable(o):
                        value = yield from self.allocations.allocating(s, o, ALLOCATE_SLICE_BLOCKS)
                    elif every and type(o) is op.Decode and len(o.request_ids) > DECODE_SLICE_ENTRIES:
                        value = yield from self.allocations.decoding(s, o, DECODE_SLICE_ENTRIES)
                    else:
                        value = handlers[type(o)](s, o)
                except ServiceError as exc:
                    out.append(op.Outcome(error=exc))
                    failed = i
                except Exception as exc:  # engine errors keep their status (errors.py)
                    out.append(op.Outcome(error=as_service_error(exc)))
                    failed = i
                else:
                    out.append(op.Outcome(value))
        finally:
            # Once for the whole Step: an operation reading the journal (TakeEvents,
            # a prefix-cache reset) publishes what came before it itself, and the
            # journal keeps the same events whether they come one by one or at once.
            self.event_feed.publish()
            if shared_stats is not None:
                s.stats = engine.prefix_cache_stats
                engine.prefix_cache_stats = shared_stats
        return out

    def check_step_size(self, n: int) -> None:
        """Raises:
        ServiceError: RESOURCE_EXHAUSTED when ``n`` operations are more than a Step may hold.
        """
        if n > self.pool.limits.max_ops_per_step:
            raise ServiceError(
                Status.EXHAUSTED,
                f"{n} operations in one Step; the limit is {self.pool.limits.max_ops_per_step}",
            )

    def free_requests(self, s: Session, request_ids: Sequence[str], preempt: bool) -> None:
        """Free (or preempt) several requests, all checked before any is touched.

        Raises:
            ServiceError: INVALID_ARGUMENT for a duplicate, NOT_FOUND
                (REQUEST_UNKNOWN) for an unknown request or another tenant's,
                PERMISSION_DENIED for another session's request of the same tenant.
        """
        drain(self.freeing_requests(s, request_ids, preempt))

    def freeing_requests(
        self, s: Session, request_ids: Sequence[str], preempt: bool, every: int = 0
    ) -> Generator[None, None, None]:
        """:meth:`free_requests` in slices: a generator that yields after every
        ``every`` requests freed (0: never), every check made before the first; nothing
        may touch this pool until it returns (pool_locks.py).

        Raises:
            ServiceError: as :meth:`free_requests`, before the first yield.
        """
        if len(set(request_ids)) != len(request_ids):
            raise ServiceError(Status.INVALID, "request_ids lists a request twice")
        for rid in request_ids:
            self.syncs.check_owned(s, rid)
        kind = op.Preempt if preempt else op.Free
        outcomes = yield from self.applying(s, [kind(rid) for rid in request_ids], every)
        for o in outcomes:
            if o.error is not None:  # pragma: no cover - every failure is checked above
                raise o.error

    def _lookup(self, s: Session, o: op.Lookup) -> op.Value:
        if o.hint:
            if o.answered is not None:
                raise ServiceError(Status.INVALID, "a lookup is either a hint or answered")
            if not s.exclusive:
                raise ServiceError(
                    Status.PRECONDITION,
                    "hint lookups need an exclusive session: with other sessions on the pool "
                    "nothing the client can see proves a hint still holds",
                )
            limit = min(o.walk_limit or DEFAULT_WALK_LIMIT, MAX_WALK_LIMIT)

            def hinted(rid: str) -> op.Value:
                hit, margin = self.pool.engine.lookup_hint(rid, limit)
                return op.Hinted(hit, margin)

            return self.syncs.with_sync(s, o.sync, hinted)
        answered = o.answered
        if answered is None:
            if self.pool.engine.rules.full_sequence_admission:  # vllm-0.33: with the junction

                def looked_up(rid: str) -> op.Value:
                    hit = self.pool.engine.get_computed_blocks(rid)
                    return op.LookedUp(hit, self.pool.engine.shared_prefix_boundary(rid))

                return self.syncs.with_sync(s, o.sync, looked_up)
            return self.syncs.with_sync(s, o.sync, self.pool.engine.get_computed_blocks)

        def checked(rid: str) -> op.Value:
            try:
                return self.pool.engine.check_lookup(rid, answered, answered.num_tokens)
            except HintMismatchError as err:
                raise ServiceError(
                    Status.PRECONDITION,
                    f"{err}; the client's proof that its hint still held was wrong: treat the "
                    "requests of this Step as lost and report this as a bug",
                    ErrorReason.PREDICTION_FAILED,
                ) from None

        return self.syncs.with_sync(s, o.sync, checked)

    def _free(self, s: Session, o: op.Free) -> op.Value:
        if o.if_held and o.request_id and self.pool.owners.get(o.request_id) is not s:
            # "Free it if I still hold it": not held by this session (its first free was
            # applied, or the id is another session's request by now), nothing to do.
            return None
        self.syncs.check_owned(s, o.request_id)
        self.pool.engine.free(o.request_id, o.all_groups_reversed, o.uncomputed_from)
        del self.pool.owners[o.request_id]
        s.owned.pop(o.request_id, None)
        return None

    def _preempt(self, s: Session, o: op.Preempt) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        self.pool.engine.preempt(o.request_id)
        return None

    def _cache_blocks(self, s: Session, o: op.CacheBlocks) -> op.Value:
        return self.syncs.with_sync(
            s, o.sync, lambda rid: self.pool.engine.cache_blocks(rid, o.num_computed_tokens)
        )

    def _remove_skipped(self, s: Session, o: op.RemoveSkipped) -> op.Value:
        return self.syncs.with_sync(
            s, o.sync, lambda rid: self.pool.engine.remove_skipped_blocks(rid, o.total_computed_tokens)
        )

    def _evict(self, s: Session, o: op.EvictBlocks) -> op.Value:
        self.pool.engine.evict_blocks(o.block_ids)
        return None

    def _get_block_ids(self, s: Session, o: op.GetBlockIds) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        if o.computed_tokens is not None:
            if o.answered is not None:
                raise ServiceError(
                    Status.INVALID,
                    "get_block_ids: computed_tokens cannot come with answered",
                )
            return self.pool.engine.get_block_ids_for_computed_tokens(o.request_id, o.computed_tokens)
        table = self.pool.engine.get_block_ids(o.request_id)
        if o.answered is not None and o.answered != table:
            raise self.allocations.prediction_failed(
                o.request_id, f"the client answered its block table with {o.answered}, the pool holds {table}"
            )
        return table

    def _common_prefix(self, s: Session, o: op.CommonPrefix) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        return self.pool.engine.get_num_common_prefix_blocks(o.request_id)

    def _reset(self, s: Session, o: op.ResetPrefixCache) -> op.Value:
        return self.pool.reset_prefix_cache()

    def _take_events(self, s: Session, o: op.TakeEvents) -> op.Value:
        budget = self.pool.answer_event_bytes
        return self.event_feed.take_events(s, budget)

    def _make_stats(self, s: Session, o: op.MakeStats) -> op.Value:
        if o.peek:
            return self.pool.engine.peek_prefix_cache_stats()
        return self.pool.engine.make_prefix_cache_stats()

    def _sync(self, s: Session, o: op.Sync) -> op.Value:
        self.syncs.sync(s, o.sync)
        return None

    def _record_stats(self, s: Session, o: op.RecordStats) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        self.pool.engine.record_prefix_cache_stats(o.request_id, o.num_hits)
        return None

    def _estimate_cached_tokens(self, s: Session, o: op.EstimateCachedTokens) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        return self.pool.engine.estimate_cached_tokens(o.request_id)

    def _new_step_starts(self, s: Session, o: op.NewStepStarts) -> op.Value:
        self.pool.engine.new_step_starts()
        return None

    def _take_new_block_ids(self, s: Session, o: op.TakeNewBlockIds) -> op.Value:
        return self.pool.engine.take_new_block_ids()

    def _take_offloads(self, s: Session, o: op.TakeBoundaryStateOffloads) -> op.Value:
        return self.pool.engine.take_boundary_state_offloads()

    def _take_copies(self, s: Session, o: op.TakeBlockCopies) -> op.Value:
        return self.pool.engine.take_kv_cache_block_copies()

    def _release_retained(self, s: Session, o: op.ReleaseRetained) -> op.Value:
        self.pool.engine.release_retained_blocks(o.block_ids)
        return None

    def _drop_offloads(self, s: Session, o: op.DropOffloads) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        self.pool.engine.drop_boundary_state_offloads(o.request_id)
        return None

    def _record_for_zeroing(self, s: Session, o: op.RecordForZeroing) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        self.pool.engine.record_blocks_for_zeroing(o.request_id, o.start_token)
        return None

    def _drop_uncomputed(self, s: Session, o: op.DropUncomputed) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        self.pool.engine.drop_uncomputed(o.request_id, o.uncomputed_from)
        return None

    def _num_blocks_to_allocate(self, s: Session, o: op.GetNumBlocksToAllocate) -> op.Value:
        self.syncs.check_owned(s, o.request_id)
        return self.pool.engine.get_num_blocks_to_allocate(
            o.request_id, o.num_tokens, o.total_computed_tokens, o.num_tokens_main_model,
            o.apply_admission_cap, o.num_encoder_tokens,
        )  # fmt: skip
