"""The Allocator's session calls: Attach (the hash handshake, the pool's state or an
exclusive session's engine state in the answer, checked against the answer size),
Heartbeat and Detach."""

from __future__ import annotations

import asyncio
from collections.abc import Generator

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import write_pool_state

from .access import current_tenant
from .attach_reset import check_resettable
from .convert import fence_from_pb, fence_to_pb, write_mirror_state
from .errors import ErrorReason, ServiceError, Status, map_errors
from .mutating_calls import ANSWER_MARGIN_BYTES
from .pool_service import PoolService, ReplicaState
from .servicer_core import ServicerCore, fence_of
from .sessions import Session
from .state_export import FORK_BLOCKS, ExportError, mirror_state_apart

__all__ = ["CAPABILITIES", "SessionCalls"]

#: AttachResponse.capabilities: the operations and calls beyond every server's this one
#: serves ("decode_op": DecodeOp; "step_stream": StepStream, step_stream.py); a client
#: uses one only when it is listed
CAPABILITIES = ("decode_op", "step_stream")


class SessionCalls(ServicerCore):
    """Attach, Heartbeat and Detach."""

    def _one_group_state(
        self, request: pb.AttachRequest, service: PoolService, tenant: str
    ) -> ReplicaState | str | None:
        """The one-group pool state (clients before the mirror: want_pool_state without
        want_engine_state) an exclusive Attach is answered with, built once, before any
        session exists, and checked against the answer size; None when built with the
        answer (none asked for, or the session will cache under a namespace: no state).

        It is built on the event loop (300,000 cached blocks held it 235 ms, and it was
        built twice), so a pool that has built FORK_BLOCKS blocks or more, whose engine
        state is encoded off the loop (state_export.py), refuses it: such a client
        attaches without prediction, as for a state too large for one answer.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED (ANSWER_TOO_LARGE) for a large pool (naming
                want_engine_state), or naming both sizes when it would not fit.
        """
        if not (request.want_pool_state and request.exclusive) or request.want_engine_state:
            return None  # (the engine's state is checked once exported: the export is the cost)
        if service.cache_namespace(tenant):
            return None
        if service.num_materialised_blocks >= FORK_BLOCKS:
            raise ServiceError(
                Status.EXHAUSTED,
                f"pool {service.name!r} has built {service.num_materialised_blocks:,} blocks: its one-group "
                f"state is given up to {FORK_BLOCKS:,} (it is built while every pool waits); no session was "
                "made: attach with want_engine_state (encoded apart), or without want_pool_state",
                ErrorReason.ANSWER_TOO_LARGE,
            )
        state = service.pool_state()
        if self.max_message_bytes and not isinstance(state, str):
            probe = pb.AttachResponse(pool=self._info(service), fence=fence_to_pb(service.fence))
            write_pool_state(probe, state)
            self._check_answer_fits(service, probe)
        return state

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

    @map_errors
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        previous = fence_from_pb(request.previous_fence, request.HasField("previous_fence"))
        service = self.registry.for_attach(request.pool, previous)  # (no such pool: proven there)
        # a worker attaching again: the fence it held proves a restore first (as its Step
        # would have: attached anew it would be handed the lost history's blocks)
        self.registry.attaching_again(previous)
        while (ending := self.expiring.get(service.name)) is not None and not ending.done():
            # a lapsed session's requests are freed in slices: its end, then this Attach
            # (after the calls waiting for the pool meanwhile, as any call on it; its
            # failure is logged by the servicer, not this call's)
            await asyncio.wait([ending])
            await self.registry.locks.wait(service.name)
            service = self.registry.for_attach(request.pool)
        tenant = current_tenant()
        state = self._one_group_state(request, service, tenant.name)
        # a retry whose first answer was lost gets the session that Attach made; its answer
        # waits for the pool's records as the first's does (marked before the lookup: was, a
        # retry told a session whose record the store write given up lost, its next owner without it)
        self.mutations.answers_on(service.name)
        s = self.registry.attached_before(service, request.attach_key, tenant.name, request.exclusive)
        new = s is None
        if s is None:
            if request.reset_prefix_cache:
                check_resettable(service)
            s = self._new_session(request, service, tenant.name, tenant.max_sessions)
            if request.reset_prefix_cache and state is not None and not isinstance(state, str):
                state = service.pool_state()  # (the one-group state after the reset)
        response = pb.AttachResponse(
            pool=self._info(service),
            session_id=s.session_id,
            lease_seconds=s.lease_seconds,
            idempotency_window_seconds=self.registry.idempotency.window,
            fence=fence_to_pb(service.fence),
            exclusive=s.exclusive,
            capabilities=CAPABILITIES,
            prefix_cache_reset=s.reset_at_attach,
            max_ops_per_step=service.limits.max_ops_per_step,
        )
        recorded = not new  # (a retry's session was journaled when it was made)
        if request.want_pool_state and request.want_engine_state and s.exclusive:
            if new:  # journaled before the wait: a snapshot taken meanwhile holds the session
                self.mutations.record(lambda r: r.attached(service, s))
                recorded = True
            await self._export_engine_state(service, s, response, new)
        elif request.want_pool_state:
            if not s.exclusive:
                state = "the session is not exclusive"
            write_pool_state(response, service.pool_state() if state is None else state)
        if new:
            self.observer.attached(service)
        if recorded:
            return await self._durable(response)
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
                request.reset_prefix_cache,
            )
        except ServiceError as exc:
            # only the hash handshake: an exclusive pool's refusal is not a hashing fault
            if exc.reason in (ErrorReason.HASH_MISMATCH, ErrorReason.PROFILE_MISMATCH):
                self.observer.handshake_refused(request.pool)
            raise
        s.attach_key = request.attach_key
        s.reset_at_attach = request.reset_prefix_cache
        return s

    async def _export_engine_state(
        self, service: PoolService, s: Session, response: pb.AttachResponse, new: bool = True
    ) -> None:
        """The engine's state at the new exclusive session's start into ``response``,
        encoded off the loop for a large pool (state_export.py). A ``new`` session is
        journaled already (a snapshot taken during the wait holds it): when the answer
        cannot be sent (too large, the pool deleted or handed over meanwhile, the call
        cancelled) it ends, and its end is journaled too (a retried Attach's session is
        left to its lease).

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
                self.registry.end_session(s, service)
                self.mutations.record(lambda r: r.detached(service, s.session_id))
            raise

    @map_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        service, s = self.registry.session_of(request.session_id, fence_of(request), request.pool)
        return self.mutations.positioned(
            pb.HeartbeatResponse(lease_seconds=s.lease_seconds, fence=fence_to_pb(service.fence))
        )

    @map_errors
    async def Detach(self, request: pb.DetachRequest, context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        service, s = self.registry.session_of(request.session_id, fence_of(request), request.pool)

        def detaching() -> Generator[None, None, int]:
            # Run once the pool is free, which may be after the session ended meanwhile
            # (another Detach of it, a proven restore, its pool deleted): such a Detach
            # is refused as one arriving after the end (else it would journal a second
            # end, which no restart can replay), and changes nothing.
            self.registry.session_of(request.session_id, fence_of(request), request.pool)
            freed = yield from self.registry.ending(s, service)
            self.observer.detached(service.name)
            # recorded after the change: a snapshot the record triggers holds the state after it
            self.mutations.record(lambda r: r.detached(service, s.session_id))
            return freed

        # The session ends for every call at once; a large one's requests are freed a
        # slice at a time, its pool held, other pools served between slices (65,536
        # requests at once held the loop 267 ms). A cancelled call's Detach goes on.
        freed = await asyncio.shield(self.mutations.start_holding(service.name, detaching()))
        return await self._durable(pb.DetachResponse(num_freed_requests=freed))
