"""The Allocator gRPC servicer: message in, pool service call, message out.

Every rule (sessions, ownership, positioned sync, Step semantics, cursors, fencing)
lives in :mod:`.pool_service`, :mod:`.sessions` and :mod:`.idempotency`; a keyed
call's idempotency, journal record and commit wait in :mod:`.mutations` (which
replays it with the same :class:`~.mutations.Mutation`); errors become gRPC statuses
in :mod:`.errors`. This module only translates. Handlers run on the server's event
loop and never await inside a pool call, so each pool sees one operation at a time, in arrival order;
a large Step is applied in slices with its pool held (:mod:`.pool_locks`), and every call
that may touch that pool waits for it first (the guard's ``pools_free``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from kvcoord.wire import (
    add_events,
    block_ids_to_pb,
    event_to_pb,
    events_digest,
    hit_to_pb,
    stats_to_pb,
    write_pool_state,
)

from . import bounds
from . import operations as op
from .access import FULL_ACCESS, AccessControl, Role, current_tenant
from .bounds import check_request_slices
from .budget import BLOCK_BYTES, TOKEN_BYTES
from .convert import (
    allocate_from_pb,
    allocate_to_pb,
    fence_from_pb,
    fence_to_pb,
    operation_from_pb,
    prompts_from_pb,
    reservation_stats_to_pb,
    reservation_to_pb,
    scores_to_pb,
    write_mirror_state,
    write_results,
)
from .durability import Recorder
from .errors import (
    REASON_METADATA_KEY,
    STOPPING_AFTER_JOURNAL_FAILURE,
    ErrorReason,
    ServiceError,
    Status,
    grpc_code,
    map_errors,
    map_stream_errors,
)
from .idempotency import score_key_owner
from .long_syncs import allocate_in_slices, is_long
from .mutations import SERIALIZE_SLICE_OPS, SLICE_PAUSE, SLICE_SECONDS, Mutation, MutationRunner
from .pool_service import Fence, Limits, PoolService, drain
from .registry import PoolRegistry
from .score_wire import ScoreEncoder
from .scoring import Reserve, score_pools
from .sessions import Session
from .state_export import ExportError, mirror_state_apart
from .step_stream import StepStreams, step_stream_handler
from .wire_slices import parse_in_turns

__all__ = [
    "AllocatorServicer",
    "NullObserver",
    "OperationObserver",
    "add_servicer",
    "allocate_answer",
    "free_answer",
    "step_answer",
    "step_weight",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class OperationObserver(Protocol):
    """Told about pool lifecycle and session changes (metrics)."""

    def pool_created(self, service: PoolService) -> None: ...
    def pool_deleted(self, service: PoolService) -> None: ...
    def attached(self, service: PoolService) -> None: ...
    def detached(self, pool: str) -> None: ...
    def handshake_refused(self, pool: str) -> None: ...
    def session_expired(self, pool: str) -> None: ...
    def step_applied(self, pool: str, operations: int, seconds: float) -> None: ...
    def events_gap(self, pool: str, stream: str) -> None: ...


class NullObserver:
    """An observer that ignores everything; subclass it to watch only some events."""

    def pool_created(self, service: PoolService) -> None:
        pass

    def pool_deleted(self, service: PoolService) -> None:
        pass

    def attached(self, service: PoolService) -> None:
        pass

    def detached(self, pool: str) -> None:
        pass

    def handshake_refused(self, pool: str) -> None:
        pass

    def session_expired(self, pool: str) -> None:
        pass

    def step_applied(self, pool: str, operations: int, seconds: float) -> None:
        pass

    def events_gap(self, pool: str, stream: str) -> None:
        pass


def _fence(request: Any) -> Fence | None:
    return fence_from_pb(request.fence, request.HasField("fence"))


#: what an answer keeps free besides its events or pool state (fields written after
#: the budget is taken: statistics, flags, the session id, gRPC's framing)
ANSWER_MARGIN_BYTES = 1024
#: AttachResponse.capabilities: the operations and calls beyond every server's this one
#: serves ("decode_op": DecodeOp; "step_stream": StepStream, step_stream.py); a client
#: uses one only when it is listed
CAPABILITIES = ("decode_op", "step_stream")


class AllocatorServicer(pb_grpc.AllocatorServicer):
    """Translates each RPC into calls on the registry and its pool services."""

    def __init__(
        self,
        registry: PoolRegistry,
        observer: OperationObserver | None = None,
        watch_poll_seconds: float = 1.0,
        access: AccessControl | None = None,
        max_message_bytes: int = 0,
    ) -> None:
        self.registry = registry
        self.observer: OperationObserver = observer or NullObserver()
        registry.on_session_expired = self._session_expired
        self.watch_poll_seconds = watch_poll_seconds
        self.stopping = False
        #: the open StepStream calls (step_stream.py), ended when the server stops
        self.step_streams = StepStreams()
        #: set when the journal could not be written: every call is refused from then on
        self.journal_failure: str | None = None
        self._teardowns: set[asyncio.Task[None]] = set()
        #: who may call what (every caller has full access when none is given)
        self.access = access or AccessControl((), (), registry.sessions)
        #: the gRPC receive limit, reported in GetStats
        self.max_message_bytes = max_message_bytes
        #: runs the keyed calls (idempotency, journal, commit wait)
        self.mutations = MutationRunner(registry, max_message_bytes)
        #: ScorePools answers without block ids, encoded from parts kept per pool
        self._score_encoder = ScoreEncoder(4 * registry.limits.max_pools)
        #: the Step mutation, observed (engine time, operations, event gaps) for metrics
        self._step = dataclasses.replace(
            STEP,
            apply=functools.partial(_apply_step, observer=self.observer),
            slices=functools.partial(_step_slices, observer=self.observer),
        )

    def _info(self, p: PoolService) -> pb.PoolInfo:
        """The pool as the caller may see it (other tenants' names only to its administrators)."""
        return pb.PoolInfo(
            name=p.name,
            config=self.access.pool_config_for(current_tenant(), p.name, p.wire_config),
            coordinator=p.config.coordinator_kind,
            num_free_blocks=p.num_free_blocks,
            usage=p.usage,
            num_requests=p.num_requests,
            fence=fence_to_pb(p.fence),
            replica=self.registry.placement.replica_id,
        )

    async def _durable(self, response: M, record: Callable[[Recorder], None] | None = None) -> M:
        """Journal the call (``record``), then answer once every mutation so far is
        durable (mutations.py)."""
        return await self.mutations.durable(response, record)

    def journal_failed(self, exc: BaseException) -> None:
        """Refuse every later call (UNAVAILABLE): state in memory is ahead of the disk, so
        neither a mutation nor a read of it may be answered (the server then exits)."""
        self.journal_failure = str(exc)

    def check_serving(self) -> None:
        """Raises:
        ServiceError: UNAVAILABLE once the journal failed (:meth:`journal_failed`).
        """
        if self.journal_failure is not None:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"journal write failed ({self.journal_failure}); {STOPPING_AFTER_JOURNAL_FAILURE}",
            )

    async def wait_for_pools(self, request: Any) -> None:
        """Return once no Step is applied in slices to a pool the call may touch (the
        pool it names, the pool of the session it names, else every pool); the handler
        then runs on without awaiting before it reads or changes that pool."""
        locks = self.registry.locks
        if not locks.any_busy():
            return
        pool = _pool_named(request, self.registry)
        if pool is None:
            await locks.wait_all()
        else:
            await locks.wait(pool)

    def reap_expired_sessions(self) -> int:
        """Free the requests of every session whose lease ran out."""
        if self.journal_failure is not None or self.registry.locks.any_busy():
            return 0  # (a pool mid-Step: the next round reaps them)
        return len(self.registry.reap_expired_sessions())

    def _session_expired(self, pool: str) -> None:
        self.observer.detached(pool)
        self.observer.session_expired(pool)

    # -- pools ------------------------------------------------------------------
    @map_errors
    async def CreatePool(
        self, request: pb.CreatePoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreatePoolResponse:
        await self.registry.placement.before_create(request.name)
        service, created = self.registry.create(request.name, request.config)
        if created:
            self.observer.pool_created(service)
        return await self._durable(pb.CreatePoolResponse(pool=self._info(service), created=created))

    @map_errors
    async def GetPool(
        self, request: pb.GetPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPoolResponse:
        return pb.GetPoolResponse(pool=self._info(self.registry.get(request.name)))

    @map_errors
    async def ListPools(
        self, request: pb.ListPoolsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPoolsResponse:
        pools = self.registry.served()
        tenant = current_tenant()
        visible = [n for n in sorted(pools) if self.access.visible(tenant, n)]
        return pb.ListPoolsResponse(pools=[self._info(pools[n]) for n in visible])

    @map_errors
    async def DeletePool(
        self, request: pb.DeletePoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeletePoolResponse:
        registry = self.registry
        if await registry.placement.delete_unserved(request.name):  # a cluster's pool nobody served
            return pb.DeletePoolResponse()
        registry.get(request.name)  # NOT_FOUND, or the owner's redirect, before anything changes
        # In a store-journal cluster the pool is gone from the cluster after this (so
        # it is no longer claimed here: removed without the placement check again).
        await registry.placement.before_delete(request.name)
        await registry.locks.wait(request.name)  # a Step applied to it in slices ends first
        if request.name not in registry.pools:
            registry.get(request.name)  # deleted by another call meanwhile: NOT_FOUND
        service = registry.remove(request.name)
        self.observer.pool_deleted(service)
        await self.registry.placement.after_delete(request.name)
        # Freeing millions of used blocks at once would stall every pool: release them
        # a slice at a time between other calls.
        task = asyncio.get_running_loop().create_task(_tear_down(service))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)
        return await self._durable(pb.DeletePoolResponse())

    async def teardowns_done(self) -> None:
        """Return once every deleted pool's sliced teardown has finished."""
        while self._teardowns:
            await asyncio.gather(*self._teardowns)

    def _check_pool_state_fits(self, request: pb.AttachRequest, service: PoolService, tenant: str) -> None:
        """Refuse an exclusive Attach whose pool state would not fit in its answer,
        before any session exists.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED (ANSWER_TOO_LARGE) naming both sizes.
        """
        if not (request.want_pool_state and request.exclusive and self.max_message_bytes):
            return
        if request.want_engine_state:  # checked once exported (Attach): the export is the cost
            return
        probe = pb.AttachResponse(pool=self._info(service), fence=fence_to_pb(service.fence))
        if service.cache_namespace(tenant):  # the session will cache under a namespace: no state
            return
        state = service.pool_state()
        if isinstance(state, str):
            return
        write_pool_state(probe, state)
        self._check_answer_fits(service, probe)

    def _check_answer_fits(self, service: PoolService, answer: pb.AttachResponse) -> None:
        """Raises: ServiceError: RESOURCE_EXHAUSTED (ANSWER_TOO_LARGE) naming both sizes."""
        size = answer.ByteSize() + ANSWER_MARGIN_BYTES
        if self.max_message_bytes and size > self.max_message_bytes:
            raise ServiceError(
                Status.EXHAUSTED,
                f"the state of pool {service.name!r} takes about {size:,} bytes, more than one answer may "
                f"(max_message_bytes {self.max_message_bytes:,}); no session was made: attach without "
                "want_pool_state (no prediction) or raise server.max_message_bytes",
                ErrorReason.ANSWER_TOO_LARGE,
            )

    # -- sessions -----------------------------------------------------------------
    @map_errors
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        service = self.registry.for_attach(request.pool)
        tenant = current_tenant()
        self._check_pool_state_fits(request, service, tenant.name)
        # a retry whose first answer was lost gets the session that Attach made
        s = self.registry.attached_before(service, request.attach_key, tenant.name, request.exclusive)
        new = s is None
        if s is None:
            s = self._new_session(request, service, tenant.name, tenant.max_sessions)
        response = pb.AttachResponse(
            pool=self._info(service),
            session_id=s.session_id,
            lease_seconds=s.lease_seconds,
            idempotency_window_seconds=self.registry.idempotency.window,
            fence=fence_to_pb(service.fence),
            exclusive=s.exclusive,
            capabilities=CAPABILITIES,
        )
        if request.want_pool_state and request.want_engine_state and s.exclusive:
            await self._export_engine_state(service, s, response, new)
        elif request.want_pool_state:
            write_pool_state(
                response, service.pool_state() if s.exclusive else "the session is not exclusive"
            )
        if not new:  # journaled and counted when it was made
            return await self._durable(response)
        self.observer.attached(service)
        return await self._durable(response, lambda r: r.attached(service, s))

    def _new_session(
        self, request: pb.AttachRequest, service: PoolService, tenant: str, most: int
    ) -> Session:
        """The hash handshake, then a new session of ``tenant`` (``most``: its session limit)."""
        try:
            s = service.attach(
                request.hash_algo,
                request.hash_block_size,
                request.hash_seed,
                request.client_name,
                request.lease_seconds,
                request.exclusive,
                tenant,
                most,
                request.profile,
                request.num_hash_lookahead_tokens,
            )
        except ServiceError as exc:
            # only the hash handshake: an exclusive pool's refusal is not a hashing fault
            if exc.reason in (ErrorReason.HASH_MISMATCH, ErrorReason.PROFILE_MISMATCH):
                self.observer.handshake_refused(request.pool)
            raise
        s.attach_key = request.attach_key
        return s

    async def _export_engine_state(
        self, service: PoolService, s: Session, response: pb.AttachResponse, new: bool = True
    ) -> None:
        """The engine's state at the new exclusive session's start into ``response``,
        encoded off the loop for a large pool (state_export.py). Nothing of a ``new``
        session is journaled yet: when the answer cannot be sent (too large, the pool
        deleted or handed over meanwhile, the call cancelled) it ends unrecorded (a
        retried Attach's session, journaled already, is left to its lease).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED (ANSWER_TOO_LARGE); UNAVAILABLE when the
                pool left this server or the export failed (attach again).
        """
        try:
            try:
                state = await mirror_state_apart(service, s.cache_namespace)
            except ExportError as exc:
                raise ServiceError(Status.UNAVAILABLE, f"exporting the pool's state failed: {exc}") from None
            if (
                self.registry.pools.get(service.name) is not service
                or s.session_id not in self.registry.sessions.sessions
            ):
                raise ServiceError(
                    Status.UNAVAILABLE,
                    f"pool {service.name!r} was deleted or moved while its state was exported: attach again",
                )
            write_mirror_state(response, state)
            self._check_answer_fits(service, response)
        except BaseException:
            if new and s.session_id in self.registry.sessions.sessions:
                service.end_session(s)
                self.registry.idempotency.drop_session(s.session_id)
            raise

    @map_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        service = self.registry.pool_of_session(request.session_id)
        s = service.session(request.session_id, _fence(request))
        return self.mutations.positioned(
            pb.HeartbeatResponse(lease_seconds=s.lease_seconds, fence=fence_to_pb(service.fence))
        )

    @map_errors
    async def Detach(self, request: pb.DetachRequest, context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        service = self.registry.pool_of_session(request.session_id)
        s = service.session(request.session_id, _fence(request))
        freed = service.end_session(s)
        self.registry.idempotency.drop_session(s.session_id)
        self.observer.detached(service.name)
        # recorded after the change: a snapshot the record triggers holds the state after it
        return await self._durable(
            pb.DetachResponse(num_freed_requests=freed), lambda r: r.detached(service, s.session_id)
        )

    # -- operations -------------------------------------------------------------------
    @map_errors
    async def FindLongestCacheHit(
        self, request: pb.FindLongestCacheHitRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindLongestCacheHitResponse:
        service = self.registry.get(request.pool)
        hit = service.find_longest_cache_hit(request.block_hashes, request.num_tokens, current_tenant().name)
        return pb.FindLongestCacheHitResponse(
            hit=hit_to_pb(hit),
            num_free_blocks=service.num_free_blocks,
            fence=fence_to_pb(service.fence),
        )

    @map_errors
    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateResponse | bytes:
        return await self.mutations.run(ALLOCATE, request, _fence(request))

    @map_errors
    async def Free(
        self, request: pb.FreeRequest, context: grpc.aio.ServicerContext
    ) -> pb.FreeResponse | bytes:
        return await self.mutations.run(FREE, request, _fence(request))

    @map_errors
    async def Step(
        self, request: pb.StepRequest, context: grpc.aio.ServicerContext
    ) -> pb.StepResponse | bytes:
        return await self.mutations.run(self._step, request, _fence(request))

    @map_errors
    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        service = self.registry.get(request.pool)
        service.check_fence(_fence(request))
        if request.session_id:
            service.session(request.session_id, None)
        result = service.reset_prefix_cache()
        return await self._durable(
            pb.ResetPrefixCacheResponse(result=result, num_free_blocks=service.num_free_blocks),
            lambda r: r.prefix_cache_reset(service),
        )

    @map_errors
    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        service = self.registry.get(request.pool)
        return pb.GetStatsResponse(
            num_free_blocks=service.num_free_blocks,
            num_total_blocks=service.config.num_blocks - 1,
            usage=service.usage,
            num_requests=service.num_requests,
            prefix_cache_stats=stats_to_pb(service.lifetime_prefix_cache_stats()),
            fence=fence_to_pb(service.fence),
            limits=self._limits(),
            pool_memory_bytes=self.registry.pool_memory.get(service.name, 0),
            event_buffer_bytes=service.events.bytes,
            event_buffer_max_bytes=service.events.max_bytes,
            reservations=reservation_stats_to_pb(service.reservations),
            num_sessions=len(self.registry.sessions.of_pool(service.name)),
        )

    def _limits(self) -> pb.ServerLimits:
        reg = self.registry
        lim = reg.limits
        tenant = current_tenant()
        return pb.ServerLimits(
            max_pools=lim.max_pools,
            max_blocks_per_pool=lim.max_blocks_per_pool,
            max_requests_per_pool=lim.max_requests_per_pool,
            max_ops_per_step=lim.max_ops_per_step,
            event_buffer=lim.event_buffer,
            max_tokens_per_request=lim.max_tokens_per_request,
            max_pool_memory_bytes=lim.max_pool_memory_bytes,
            pool_memory_bytes=reg.memory.used,
            pool_block_bytes=BLOCK_BYTES,
            pool_token_bytes=TOKEN_BYTES,
            max_sessions_per_tenant=tenant.max_sessions or lim.max_sessions_per_tenant,
            tenant_sessions=reg.sessions.count_of_tenant(tenant.name),
            max_session_lease_seconds=reg.sessions.max_lease,
            max_message_bytes=self.max_message_bytes,
            idempotency_max_bytes=reg.idempotency.max_bytes,
            idempotency_bytes=reg.idempotency.bytes,
            idempotency_keys=len(reg.idempotency),
            server_sessions=len(reg.sessions.sessions),
            max_name_length=bounds.MAX_NAME_LENGTH,
            max_request_id_length=bounds.MAX_REQUEST_ID_LENGTH,
            max_idempotency_key_length=bounds.MAX_IDEMPOTENCY_KEY_LENGTH,
            max_client_name_length=bounds.MAX_CLIENT_NAME_LENGTH,
        )

    @map_errors
    async def CheckPool(
        self, request: pb.CheckPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckPoolResponse:
        service = self.registry.get(request.pool)
        result = service.check()
        return pb.CheckPoolResponse(
            violations=list(result.violations),
            num_blocks_checked=result.num_blocks,
            num_requests_checked=result.num_requests,
            num_cached_blocks=result.num_cached_blocks,
            fence=fence_to_pb(service.fence),
        )

    @map_errors
    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        service = self.registry.get(request.pool)
        return pb.ListSessionsResponse(
            sessions=[
                pb.SessionInfo(
                    session_id=s.session_id,
                    client_name=s.client_name,
                    tenant=s.tenant,
                    exclusive=s.exclusive,
                    lease_seconds=s.lease_seconds,
                    expires_in_seconds=left,
                    num_requests=len(s.owned),
                )
                for s, left in self.registry.sessions.listing(service.name)
            ],
            fence=fence_to_pb(service.fence),
        )

    @map_errors
    async def InspectPool(
        self, request: pb.InspectPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.InspectPoolResponse:
        seen = self.registry.get(request.pool).inspect(
            request.request_ids, request.all_requests, request.free_queue_limit, request.include_cached_blocks
        )
        return pb.InspectPoolResponse(
            num_free_blocks=seen.num_free_blocks,
            usage=seen.usage,
            free_queue_head=seen.free_queue_head,
            requests=[
                pb.RequestState(
                    request_id=r.request_id,
                    groups=block_ids_to_pb(r.block_ids),
                    num_computed_tokens=r.num_computed_tokens,
                    num_tokens=r.num_tokens,
                )
                for r in seen.requests
            ],
            cached_block_ids=seen.cached_block_ids,
        )

    # -- routing ------------------------------------------------------------------------
    @map_errors
    async def ScorePools(
        self, request: pb.ScorePoolsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScorePoolsResponse | bytes:
        """Scores, best first; without block ids or a reservation, as the encoded bytes
        of the answer (:class:`~kvcoord.service.score_wire.ScoreEncoder`)."""
        tenant = current_tenant()
        limits = self.registry.limits
        reserve = None
        digest = b""  # a reserving call's key's digest (none: no key)
        if request.reserve_seconds:
            reserve = Reserve(
                request.reserve_seconds,
                lambda pool: self.access.holds(tenant, Role.USE, pool),
                limits.max_reservation_seconds,
                limits.max_reservations_per_tenant,
            )
            if request.idempotency_key:
                digest, kept = self.mutations.kept_unjournaled(
                    score_key_owner(tenant.name), "ScorePools", request, pb.ScorePoolsResponse
                )
                if kept is not None:  # a retry: the first answer, nothing reserved again
                    return await self._durable(kept)
        scores = score_pools(
            self.registry.served(),
            # full access holds every role: no check per pool (64 pools: about 30 us)
            _everywhere if tenant.full_access else lambda pool: self.access.holds(tenant, Role.OBSERVE, pool),
            list(request.candidate_pools),
            request.num_tokens,
            prompts_from_pb(request.prompts),
            tenant.name,
            reserve,
            # hit lengths alone through the cross-pool index unless block ids are asked for
            None if request.include_block_ids else self.registry.score_index,
        )
        if reserve is None and not request.include_block_ids:
            # a router's usual call: the answer's bytes joined from parts kept per pool
            # (add_servicer sends them as they are)
            return self._score_encoder.encode(scores.scores, scores.unscored)
        response = scores_to_pb(scores.scores, scores.unscored, request.include_block_ids)
        made = scores.reservation
        if made is None:
            response.reservation_skipped = scores.reservation_skipped
            return response
        response.reservation.CopyFrom(reservation_to_pb(made))
        if digest:
            self.mutations.keep_unjournaled(
                score_key_owner(tenant.name), "ScorePools", request, digest, response
            )
        held = self.registry.pools[made.pool]
        return await self._durable(
            response,
            lambda r: r.reserved(held, made.reservation_id, made.num_tokens, made.hashes, made.tenant),
        )

    def expire_reservations(self) -> int:
        """Release every reservation whose time ran out (journaled); how many."""
        if self.journal_failure is not None:
            return 0
        n = 0
        for service in list(self.registry.pools.values()):
            if self.registry.locks.busy(service.name):
                continue  # mid-Step: the next round releases them
            for reservation_id in service.expired_reservations():
                service.release_reservation(reservation_id)
                # called at once, inside the loop: the loop variables are the current ones
                self.mutations.record(lambda r: r.reservation_released(service, reservation_id))  # noqa: B023
                n += 1
        return n

    @map_stream_errors
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        service = self.registry.get(request.pool)
        journal = service.events
        fence = fence_to_pb(service.fence)
        cursor = request.after_sequence
        # Another history (restart, re-created pool, or a cursor this history never
        # reached): start over from the oldest kept event, flagged as a reset.
        other = request.HasField("fence") and (
            not service.knows_instance(request.fence.instance_id)
            or request.fence.incarnation != fence.incarnation
        )
        reset = other or cursor > journal.visible_sequence
        if reset:
            cursor = 0
        # A tenant that does not administer the pool reads its own cache namespace only
        # (as TakeEvents does): other tenants' token ids and hashes never reach it.
        tenant = current_tenant()
        visible = service.events_filter(tenant.name, Role.ADMINISTER in tenant.roles_on(service.name))
        # Sequence numbers start at 1 in each pool incarnation and go on across
        # restarts (recovery restores the counter with the kept events), so a cursor
        # of 0 (fresh or reset) missed events exactly when sequence 1 is no longer kept.
        # The gap (and reset) flag rides on the next event this watcher is sent.
        gap = False
        while not self.stopping and not journal.closed:
            gap = gap or journal.missed(cursor)
            items = journal.since(cursor, limit=1024, upto=journal.visible_sequence)
            sent = False
            for seq, event in items:
                cursor = seq
                if visible is not None and not visible(event):
                    continue
                if gap:
                    self.observer.events_gap(service.name, "watch")
                yield pb.WatchEventsResponse(
                    sequence=seq, event=event_to_pb(event), gap=gap, fence=fence, reset=reset
                )
                gap = reset = False
                sent = True
            if not items:
                # suspends until an event is deliverable (never returns at once while
                # none is: a commit behind the oldest kept event must not spin the loop)
                await journal.wait(cursor, self.watch_poll_seconds)
            elif not sent:
                await asyncio.sleep(0)  # a batch of other tenants' events: let others run


# The answers of the mutating calls are built only here, from the pool's state, so
# recovery (recovery.py) rebuilds each journaled answer byte for byte from the replayed
# state: the journal keeps a digest of the answer, never the answer itself.
def allocate_answer(service: PoolService, outcome: op.Outcome, fence: pb.Fence) -> pb.AllocateResponse:
    """The answer to an applied Allocate (``outcome`` holds no error)."""
    assert isinstance(outcome.value, op.AllocateOutcome)
    return pb.AllocateResponse(
        result=allocate_to_pb(outcome.value),
        num_free_blocks=service.num_free_blocks,
        usage=service.usage,
        fence=fence,
    )


def free_answer(service: PoolService, fence: pb.Fence) -> pb.FreeResponse:
    """The answer to an applied Free."""
    return pb.FreeResponse(num_free_blocks=service.num_free_blocks, fence=fence)


def step_weight(ops: list[op.Operation]) -> tuple[int, bool]:
    """A Step's operations as the engine applies them, and whether one is a TakeEvents.

    An AllocateRun counts each entry and each check, a Decode each entry, an Admit each request it may
    admit, any other operation one: what ``kvcoord_step_operations_total`` counts, so
    that engine time per operation means the same whether a client sends a decode
    step as one run or as one AllocateOp per request."""
    n = 0
    takes_events = False
    allocate = op.Allocate
    for o in ops:
        if type(o) is allocate:  # most of a Step: one each (checked first, the cheapest test)
            n += 1
        elif isinstance(o, op.AllocateRun):
            n += len(o.request_ids) + (len(o.checks.request_ids) if o.checks is not None else 0)
        elif isinstance(o, op.Decode):
            n += len(o.request_ids)
        elif isinstance(o, op.Admit):
            n += len(o.syncs)
        else:
            n += 1
            takes_events = takes_events or isinstance(o, op.TakeEvents)
    return n, takes_events


def step_answer(
    service: PoolService,
    s: Session,
    request: pb.StepRequest,
    ops: list[op.Operation],
    outcomes: list[op.Outcome],
    fence: pb.Fence,
    max_message_bytes: int = 0,
) -> pb.StepResponse:
    """The answer to an applied Step; with ``include_state`` it takes the session's
    events and statistics (its cursor moves), as the call did. Below
    ``max_message_bytes`` (0: no bound) events past what fits are kept for the next
    call (``events_more``), never lost in a refused answer. Replay (recovery.py) builds
    the same answer under the budget the call was answered with."""
    return drain(_answer_slices(service, s, request, ops, outcomes, fence, max_message_bytes, 0))


def _answer_slices(
    service: PoolService,
    s: Session,
    request: pb.StepRequest,
    ops: list[op.Operation],
    outcomes: list[op.Outcome],
    fence: pb.Fence,
    max_message_bytes: int,
    every: int,
) -> Generator[None, None, pb.StepResponse]:
    """:func:`step_answer`, yielding after every ``every`` results written (0: never)."""
    response = pb.StepResponse(num_free_blocks=service.num_free_blocks, usage=service.usage, fence=fence)
    if every and len(ops) > every:
        for k in range(0, len(ops), every):
            write_results(response, ops[k : k + every], outcomes[k : k + every])
            yield
    else:
        write_results(response, ops, outcomes)
    if request.include_state:
        if request.events_digest or not max_message_bytes:
            taken = service.take_events(s)
        else:
            full = max_message_bytes - ANSWER_MARGIN_BYTES
            taken = service.take_events(s, full - response.ByteSize(), full)
            response.events_more = taken.more
        if request.events_digest:
            response.events_sha256 = events_digest(taken.events)
        else:
            add_events(response.events, taken.events)
        response.events_gap = taken.gap
        stats = stats_to_pb(service.make_stats(s))
        if stats is not None:
            response.prefix_cache_stats.CopyFrom(stats)
    return response


def _apply_allocate(
    service: PoolService, s: Session, request: pb.AllocateRequest, fence: Fence, max_message_bytes: int
) -> pb.AllocateResponse | ServiceError:
    return drain(_allocate_slices(service, s, request, fence, max_message_bytes, 0))


def _allocate_slices(
    service: PoolService, s: Session, request: pb.AllocateRequest, fence: Fence, max_message_bytes: int,
    every: int,
) -> Generator[None, None, pb.AllocateResponse | ServiceError]:  # fmt: skip
    """An Allocate applied, a large one's blocks taken and cached in slices (yielding
    between them: pool_service.py's SLICED_ALLOCATE_TOKENS) when ``every`` is not 0."""
    groups = len(service.config.groups)
    ops: list[op.Operation] = [
        (yield from allocate_in_slices(request.op, groups)) if every else allocate_from_pb(request.op, groups)
    ]
    (outcome,) = yield from service.applying(s, ops, every)
    if outcome.error is not None:
        # A refusal turned into an error (must_succeed) has still removed skipped
        # blocks, as vLLM's refusals do: the call is journaled, so recovery replays it too.
        return outcome.error
    return allocate_answer(service, outcome, fence_to_pb(fence))


def _apply_free(
    service: PoolService, s: Session, request: pb.FreeRequest, fence: Fence, max_message_bytes: int
) -> pb.FreeResponse:
    return drain(_free_slices(service, s, request, fence, max_message_bytes, 0))


def _free_slices(
    service: PoolService, s: Session, request: pb.FreeRequest, fence: Fence, max_message_bytes: int,
    every: int,
) -> Generator[None, None, pb.FreeResponse]:  # fmt: skip
    """A Free applied, yielding after every ``every`` requests freed (0: never)."""
    yield from service.freeing_requests(s, request.request_ids, request.preempt, every)
    return free_answer(service, fence_to_pb(fence))


def _apply_step(
    service: PoolService, s: Session, request: pb.StepRequest, fence: Fence, max_message_bytes: int,
    observer: OperationObserver | None = None,
) -> pb.StepResponse:  # fmt: skip
    return drain(_step_slices(service, s, request, fence, max_message_bytes, 0, observer))


def _step_slices(
    service: PoolService, s: Session, request: pb.StepRequest, fence: Fence, max_message_bytes: int,
    every: int, observer: OperationObserver | None = None,
) -> Generator[None, None, pb.StepResponse]:  # fmt: skip
    """A Step read, applied and answered, yielding after every ``every`` operations
    read, applied or answered (0: never); the pool's engine time goes to
    ``observer`` (a live call: replay observes nothing)."""
    service.check_step_size(len(request.ops))  # before any operation is read
    groups = len(service.config.groups)
    wire = request.ops
    if every and len(wire) > every:
        ops: list[op.Operation] = []
        for k in range(0, len(wire), every):
            ops.extend([operation_from_pb(o, groups) for o in wire[k : k + every]])
            yield
    else:
        ops = []
        for o in wire:  # (a long AllocateOp's tokens read in slices: long_syncs.py)
            long = every and o.WhichOneof("op") == "allocate" and is_long(o.allocate)
            ops.append(
                (yield from allocate_in_slices(o.allocate, groups)) if long else operation_from_pb(o, groups)
            )
    seconds = 0.0
    work = service.applying(s, ops, every)
    while True:
        t0 = time.perf_counter()
        try:
            next(work)
        except StopIteration as done:
            outcomes: list[op.Outcome] = done.value
            seconds += time.perf_counter() - t0
            break
        seconds += time.perf_counter() - t0
        yield
    response = yield from _answer_slices(
        service, s, request, ops, outcomes, fence_to_pb(fence), max_message_bytes, every
    )
    if observer is not None:  # a live call (replay observes nothing)
        weight, takes_events = step_weight(ops)
        observer.step_applied(service.name, weight, seconds)
        if response.events_gap or (
            takes_events and any(isinstance(o.value, op.EventsTaken) and o.value.gap for o in outcomes)
        ):
            observer.events_gap(service.name, "step")
    if every:  # what the Step made, dropped a slice at a time (at once: 45 ms for 65,536 operations)
        for k in range(len(ops) - every, -every, -every):
            del ops[max(k, 0) :], outcomes[max(k, 0) :]
            yield
    return response


#: the keyed mutating calls, run live and replayed alike (mutations.py)
ALLOCATE = Mutation(
    "Allocate",
    pb.AllocateRequest.FromString,
    pb.AllocateResponse.FromString,
    _apply_allocate,
    _allocate_slices,
)
FREE = Mutation("Free", pb.FreeRequest.FromString, pb.FreeResponse.FromString, _apply_free, _free_slices)
STEP = Mutation("Step", pb.StepRequest.FromString, pb.StepResponse.FromString, _apply_step, _step_slices)
MUTATIONS = {m.rpc: m for m in (ALLOCATE, FREE, STEP)}


async def _tear_down(service: PoolService) -> None:
    for _ in service.teardown():
        await asyncio.sleep(0)


class _Undecodable:
    """Stands for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error


def _parser(cls: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return _Undecodable(cls.DESCRIPTOR.full_name, str(exc)[:200])

    return parse


#: methods whose request is parsed from its bytes in slices between other calls
#: (wire_slices.py: a 14.7 MB Step held the event loop 120-210 ms in gRPC's parser)
_SLICED_PARSE = frozenset({"Step"})


def _parsed_in_turns(cls: type[Message], behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """``behaviour`` given the request its bytes parse into, parsed in slices."""

    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request: Any = await parse_in_turns(cls, data, SLICE_SECONDS, SLICE_PAUSE)
        except (DecodeError, ValueError, RuntimeError) as exc:
            request = _Undecodable(cls.DESCRIPTOR.full_name, str(exc)[:200])
        return await behaviour(request, context)

    return unary


def _pool_named(request: Any, registry: PoolRegistry) -> str | None:
    """The pool a request names (by name, or by its session), or None: every pool."""
    fields = request.DESCRIPTOR.fields_by_name
    for name in ("pool", "name"):
        if name in fields:
            return str(getattr(request, name))
    if "session_id" in fields:
        s = registry.sessions.sessions.get(request.session_id)
        return s.pool if s is not None else ""
    return None


def _guard(
    handler: Callable[..., Any],
    streaming: bool,
    rpc: str,
    access: AccessControl,
    serving: Callable[[], None],
    limits: Limits,
    pools_free: Callable[[Any], Awaitable[None]],
) -> Callable[..., Any]:
    """Refuse every call once the server stopped serving (``serving`` raises), check the
    caller (access.py: credentials, then the role :data:`RPC_RULES` names) and refuse
    an undecodable request or one past an input bound (bounds.py), before the handler
    sees any of them; then wait until no Step is applied in slices to a pool the
    call may touch (``pools_free``)."""

    async def admit(request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            serving()
            # (a server without credentials reads no metadata: 2 µs of gRPC's per call)
            tenant = (
                access.authenticate(context.invocation_metadata(), context.auth_context)
                if access.required
                else FULL_ACCESS
            )
            access.bind(tenant)
            if isinstance(request, _Undecodable):
                raise ServiceError(Status.INVALID, _undecodable_message(request))
            for _ in check_request_slices(request, limits, SERIALIZE_SLICE_OPS):
                await asyncio.sleep(0)  # a large Step checked a slice at a time
            access.authorize(tenant, rpc, request)
        except ServiceError as exc:
            code, message = grpc_code(exc)
            trailers = ((REASON_METADATA_KEY, exc.reason.name),) if exc.reason is not None else ()
            await context.abort(code, message, trailers)

    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await admit(request, context)
            await pools_free(request)
            async for item in handler(request, context):
                yield item

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await admit(request, context)
        await pools_free(request)
        return await handler(request, context)

    return unary


def _everywhere(_pool: str) -> bool:
    """``AccessControl.holds`` for a full-access tenant: every role on every pool."""
    return True


def _undecodable_message(r: _Undecodable) -> str:
    return f"the request is not a valid {r.message_type} message ({r.error})"


#: methods whose handler may answer with the response's bytes, encoded already
_BYTES_ANSWERS = frozenset({"ScorePools", "Allocate", "Free", "Step"})


def _as_is_or(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A response serializer that sends bytes as they are and serializes messages."""

    def serializer(response: Any) -> bytes:
        return response if type(response) is bytes else serialize(response)

    return serializer


def add_servicer(
    servicer: AllocatorServicer,
    server: grpc.aio.Server,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> None:
    """Register the Allocator service with parsers that turn undecodable bytes into
    INVALID_ARGUMENT (gRPC's default answers UNKNOWN and logs a traceback per call).
    StepStream runs each message through the Step handler registered here, wrapped by
    the server's ``interceptors`` as a unary Step is (step_stream.py)."""
    service = pb.DESCRIPTOR.services_by_name["Allocator"]
    handlers = {}
    for method in service.methods:
        if method.client_streaming:  # StepStream: built from Step's handler below
            continue
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        behaviour = _guard(
            getattr(servicer, method.name),
            method.server_streaming,
            method.name,
            servicer.access,
            servicer.check_serving,
            servicer.registry.limits,
            servicer.wait_for_pools,
        )
        factory = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        sliced = method.name in _SLICED_PARSE  # (its handler is given the bytes)
        handlers[method.name] = factory(
            _parsed_in_turns(request_cls, behaviour) if sliced else behaviour,
            request_deserializer=None if sliced else _parser(request_cls),
            response_serializer=_as_is_or(response_cls.SerializeToString)
            if method.name in _BYTES_ANSWERS
            else response_cls.SerializeToString,
        )
    handlers["StepStream"] = step_stream_handler(
        handlers["Step"], f"/{service.full_name}/Step", servicer.step_streams, interceptors
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
