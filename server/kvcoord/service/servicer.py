"""The Allocator gRPC servicer: validate, convert, call the engine, convert back."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from .convert import block_ids_to_pb, stats_to_pb
from .errors import ServiceError, grpc_code, map_errors, map_stream_errors
from .ops import apply_operation
from .registry import PoolHandle, PoolRegistry
from .sessions import SessionManager

__all__ = ["AllocatorServicer", "NullObserver", "OperationObserver"]

logger = logging.getLogger(__name__)

_ABORTED = int(grpc.StatusCode.ABORTED.value[0])
T = TypeVar("T")


class OperationObserver(Protocol):
    """Told about every applied operation and pool lifecycle change (metrics)."""

    def after_op(self, handle: PoolHandle, kind: str, op: Any, result: pb.OperationResult) -> None: ...
    def pool_created(self, handle: PoolHandle) -> None: ...
    def pool_deleted(self, handle: PoolHandle) -> None: ...
    def attached(self, handle: PoolHandle) -> None: ...
    def detached(self, pool: str) -> None: ...
    def handshake_refused(self, pool: str) -> None: ...


class NullObserver:
    """An observer that ignores everything; subclass it to watch only some events."""

    def after_op(self, handle: PoolHandle, kind: str, op: Any, result: pb.OperationResult) -> None:
        pass

    def pool_created(self, handle: PoolHandle) -> None:
        pass

    def pool_deleted(self, handle: PoolHandle) -> None:
        pass

    def attached(self, handle: PoolHandle) -> None:
        pass

    def detached(self, pool: str) -> None:
        pass

    def handshake_refused(self, pool: str) -> None:
        pass


def _replay(handle: PoolHandle, key: str, message: type[T]) -> T | None:
    """The stored answer of an earlier call with this idempotency key, if any."""
    data = handle.cached_response(key)
    return None if data is None else message.FromString(data)  # type: ignore[attr-defined]


class AllocatorServicer(pb_grpc.AllocatorServicer):
    """Every handler runs on the server's event loop and never awaits inside an engine
    call, so each pool sees one operation at a time, in arrival order."""

    def __init__(
        self,
        registry: PoolRegistry,
        sessions: SessionManager,
        observer: OperationObserver | None = None,
        watch_poll_seconds: float = 1.0,
    ) -> None:
        self.registry = registry
        self.sessions = sessions
        self.observer: OperationObserver = observer or NullObserver()
        self.watch_poll_seconds = watch_poll_seconds
        self.stopping = False

    # -- helpers ----------------------------------------------------------------
    def _pool(self, name: str, session_id: str = "") -> PoolHandle:
        if not name:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "pool is required")
        handle = self.registry.get(name)
        if session_id:
            self.sessions.touch(session_id, name)
        return handle

    def _op(self, handle: PoolHandle, session_id: str, op: pb.Operation) -> pb.OperationResult:
        kind, result = apply_operation(handle, session_id, op)
        self.observer.after_op(handle, kind, getattr(op, kind), result)
        return result

    def free_session_requests(self, session_id: str, pool: str) -> int:
        """Free every request a session owns (detach or lease expiry)."""
        handle = self.registry.pools.get(pool)
        if handle is None:
            return 0
        owned = [rid for rid, owner in handle.owners.items() if owner == session_id]
        for rid in owned:
            self._op(handle, session_id, pb.Operation(free=pb.FreeOp(request_id=rid)))
        return len(owned)

    def reap_expired_sessions(self) -> int:
        """Free the requests of every session whose lease ran out."""
        n = 0
        for s in self.sessions.expired():
            freed = self.free_session_requests(s.session_id, s.pool)
            logger.warning(
                "session %s (%s) of pool %s expired; freed %d requests",
                s.session_id,
                s.client_name,
                s.pool,
                freed,
            )
            self.observer.detached(s.pool)
            n += 1
        return n

    # -- pools ------------------------------------------------------------------
    @map_errors
    async def CreatePool(
        self, request: pb.CreatePoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreatePoolResponse:
        handle, created = self.registry.create(request.name, request.config)
        if created:
            self.observer.pool_created(handle)
        return pb.CreatePoolResponse(pool=handle.info(), created=created)

    @map_errors
    async def GetPool(
        self, request: pb.GetPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPoolResponse:
        return pb.GetPoolResponse(pool=self._pool(request.name).info())

    @map_errors
    async def ListPools(
        self, request: pb.ListPoolsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(
            pools=[self.registry.pools[n].info() for n in sorted(self.registry.pools)]
        )

    @map_errors
    async def DeletePool(
        self, request: pb.DeletePoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeletePoolResponse:
        handle = self.registry.delete(request.name)
        for sid in [s.session_id for s in self.sessions.sessions.values() if s.pool == request.name]:
            self.sessions.close(sid)
        self.observer.pool_deleted(handle)
        return pb.DeletePoolResponse()

    # -- sessions -----------------------------------------------------------------
    @map_errors
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        handle = self._pool(request.pool)
        algo, block_size, seed = handle.hash_settings
        diffs = []
        if request.hash_algo != algo:
            diffs.append(f"hash_algo is {algo!r} but the client uses {request.hash_algo!r}")
        if request.hash_block_size != block_size:
            diffs.append(f"hash_block_size is {block_size} but the client uses {request.hash_block_size}")
        if request.hash_seed != seed:
            diffs.append(f"hash_seed is {seed!r} but the client uses {request.hash_seed!r}")
        if diffs:
            self.observer.handshake_refused(request.pool)
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pool {request.pool!r} hashes differently, so no prefix would ever hit: " + "; ".join(diffs),
            )
        s = self.sessions.open(request.pool, request.client_name, float(request.lease_seconds))
        self.observer.attached(handle)
        return pb.AttachResponse(
            pool=handle.info(), session_id=s.session_id, lease_seconds=int(s.lease_seconds)
        )

    @map_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        s = self.sessions.touch(request.session_id)
        return pb.HeartbeatResponse(lease_seconds=int(s.lease_seconds))

    @map_errors
    async def Detach(self, request: pb.DetachRequest, context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        s = self.sessions.touch(request.session_id)
        self.sessions.close(s.session_id)
        freed = self.free_session_requests(s.session_id, s.pool)
        self.observer.detached(s.pool)
        return pb.DetachResponse(num_freed_requests=freed)

    # -- operations -------------------------------------------------------------------
    @map_errors
    async def FindLongestCacheHit(
        self, request: pb.FindLongestCacheHitRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindLongestCacheHitResponse:
        handle = self._pool(request.pool, request.session_id)
        result = self._op(
            handle, request.session_id, pb.Operation(lookup=pb.LookupOp(request=request.request))
        )
        return pb.FindLongestCacheHitResponse(
            hit=result.lookup.hit, num_free_blocks=handle.engine.num_free_blocks
        )

    @map_errors
    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateResponse:
        handle = self._pool(request.pool, request.session_id)
        if (replayed := _replay(handle, request.idempotency_key, pb.AllocateResponse)) is not None:
            return replayed
        result = self._op(handle, request.session_id, pb.Operation(allocate=request.op))
        response = pb.AllocateResponse(
            result=result.allocate, num_free_blocks=handle.engine.num_free_blocks, usage=handle.engine.usage
        )
        handle.remember_response(request.idempotency_key, response.SerializeToString())
        return response

    @map_errors
    async def Free(self, request: pb.FreeRequest, context: grpc.aio.ServicerContext) -> pb.FreeResponse:
        handle = self._pool(request.pool, request.session_id)
        if (replayed := _replay(handle, request.idempotency_key, pb.FreeResponse)) is not None:
            return replayed
        missing = [rid for rid in request.request_ids if not handle.engine.has_request(rid)]
        if missing:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"requests not in pool {handle.name!r}: {missing}")
        if len(set(request.request_ids)) != len(request.request_ids):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_ids lists a request twice")
        for rid in request.request_ids:  # checked up front: a refused call frees nothing
            owner = handle.owners.get(rid)
            if owner is not None and owner != request.session_id:
                raise ServiceError(
                    grpc.StatusCode.PERMISSION_DENIED, f"request {rid!r} belongs to another session"
                )
        for rid in request.request_ids:
            op = (
                pb.Operation(preempt=pb.PreemptOp(request_id=rid))
                if request.preempt
                else pb.Operation(free=pb.FreeOp(request_id=rid))
            )
            self._op(handle, request.session_id, op)
        response = pb.FreeResponse(num_free_blocks=handle.engine.num_free_blocks)
        handle.remember_response(request.idempotency_key, response.SerializeToString())
        return response

    @map_errors
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        handle = self._pool(request.pool, request.session_id)
        if (replayed := _replay(handle, request.idempotency_key, pb.StepResponse)) is not None:
            return replayed
        if len(request.ops) > handle.limits.max_ops_per_step:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(request.ops)} operations in one Step; the limit is {handle.limits.max_ops_per_step}",
            )
        results = []
        failed_at = -1
        for i, op in enumerate(request.ops):
            if failed_at >= 0:
                results.append(
                    pb.OperationResult(
                        status_code=_ABORTED, status_message=f"not applied: operation {failed_at} failed"
                    )
                )
                continue
            try:
                results.append(self._op(handle, request.session_id, op))
            except Exception as exc:  # noqa: BLE001 - reported in the result
                code, message = grpc_code(exc)
                results.append(pb.OperationResult(status_code=int(code.value[0]), status_message=message))
                failed_at = i
        response = pb.StepResponse(
            results=results, num_free_blocks=handle.engine.num_free_blocks, usage=handle.engine.usage
        )
        handle.remember_response(request.idempotency_key, response.SerializeToString())
        return response

    @map_errors
    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        handle = self._pool(request.pool, request.session_id)
        result = self._op(
            handle, request.session_id, pb.Operation(reset_prefix_cache=pb.ResetPrefixCacheOp())
        )
        return pb.ResetPrefixCacheResponse(
            result=result.reset_prefix_cache.result, num_free_blocks=handle.engine.num_free_blocks
        )

    @map_errors
    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        handle = self._pool(request.pool)
        e = handle.engine
        return pb.GetStatsResponse(
            num_free_blocks=e.num_free_blocks,
            num_total_blocks=handle.config.num_blocks - 1,
            usage=e.usage,
            num_requests=len(e.requests),
            prefix_cache_stats=stats_to_pb(e.peek_prefix_cache_stats()),
        )

    @map_errors
    async def InspectPool(
        self, request: pb.InspectPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.InspectPoolResponse:
        handle = self._pool(request.pool)
        e = handle.engine
        states = []
        rids = sorted(e.requests) if request.all_requests else request.request_ids
        for rid in rids:
            req = e.get_request(rid)
            states.append(
                pb.RequestState(
                    request_id=rid,
                    groups=block_ids_to_pb(e.get_block_ids(rid)),
                    num_computed_tokens=req.num_computed_tokens,
                    num_tokens=req.num_tokens,
                )
            )
        return pb.InspectPoolResponse(
            num_free_blocks=e.num_free_blocks,
            usage=e.usage,
            free_queue_head=e.free_queue_head(request.free_queue_limit),
            requests=states,
            cached_block_ids=e.cached_block_ids() if request.include_cached_blocks else [],
        )

    @map_stream_errors
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        handle = self._pool(request.pool)
        journal = handle.events
        cursor = request.after_sequence
        if cursor > journal.last_sequence:
            raise ServiceError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"after_sequence {cursor} is beyond the pool's last event {journal.last_sequence} "
                f"(epoch {handle.epoch}); resubscribe from 0",
            )
        gap = cursor + 1 < journal.oldest_sequence and cursor < journal.last_sequence
        while not self.stopping and not journal.closed:
            items = journal.since(cursor, limit=1024)
            for seq, event in items:
                yield pb.WatchEventsResponse(sequence=seq, event=event, gap=gap, epoch=handle.epoch)
                gap = False
                cursor = seq
            if not items:
                await journal.wait(cursor, self.watch_poll_seconds)
