"""The Allocator gRPC servicer: message in, pool service call, message out.

:class:`AllocatorServicer` holds the operations (FindLongestCacheHit, Allocate, Free,
Step); its other handlers live by role in :mod:`.pool_calls`, :mod:`.session_calls`,
:mod:`.observing_calls` and :mod:`.routing_calls`, what they share in
:mod:`.servicer_core`, the keyed calls' application and answers in
:mod:`.mutating_calls`, and the guard around every handler in :mod:`.rpc_guard`.

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

from collections.abc import Sequence

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from kvcoord.wire import hit_to_pb

from .access import current_tenant
from .convert import fence_to_pb
from .errors import map_errors
from .mutating_calls import ALLOCATE, FREE
from .observing_calls import ObservingCalls
from .pool_calls import PoolCalls
from .routing_calls import RoutingCalls
from .rpc_guard import BYTES_ANSWERS, SLICED_PARSE, as_is_or, guard, parsed_in_turns, parser
from .servicer_core import fence_of
from .session_calls import SessionCalls
from .step_stream import step_stream_handler

__all__ = ["AllocatorServicer", "add_servicer"]


class AllocatorServicer(PoolCalls, SessionCalls, ObservingCalls, RoutingCalls, pb_grpc.AllocatorServicer):
    """Translates each RPC into calls on the registry and its pool services: the
    operations here, the rest by role (pool_calls, session_calls, observing_calls,
    routing_calls; what they share in servicer_core)."""

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
    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> bytes:
        return await self.mutations.run(ALLOCATE, request, fence_of(request))

    @map_errors
    async def Free(self, request: pb.FreeRequest, context: grpc.aio.ServicerContext) -> bytes:
        return await self.mutations.run(FREE, request, fence_of(request))

    @map_errors
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> bytes:
        return await self.mutations.run(self._step, request, fence_of(request))


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
        behaviour = guard(
            getattr(servicer, method.name),
            method.server_streaming,
            method.name,
            servicer.access,
            servicer.check_serving,
            servicer.registry.limits,
            servicer.wait_for_pools,
            lambda: servicer.registry.placement.name,
        )
        factory = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        sliced = method.name in SLICED_PARSE  # (its handler is given the bytes)
        handlers[method.name] = factory(
            parsed_in_turns(request_cls, behaviour) if sliced else behaviour,
            request_deserializer=None if sliced else parser(request_cls),
            response_serializer=as_is_or(response_cls.SerializeToString)
            if method.name in BYTES_ANSWERS
            else response_cls.SerializeToString,
        )
    handlers["StepStream"] = step_stream_handler(
        handlers["Step"], f"/{service.full_name}/Step", servicer.step_streams, interceptors
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
