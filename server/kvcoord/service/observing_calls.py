"""The Allocator's calls that read a pool without changing it: GetStats (with the
server's limits), CheckPool, ListSessions, InspectPool and WatchEvents."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import block_ids_to_pb, event_to_pb, stats_to_pb

from . import bounds
from .access import Role, current_tenant
from .budget import BLOCK_BYTES, TOKEN_BYTES
from .convert import fence_from_pb, fence_to_pb
from .errors import ErrorReason, ServiceError, map_errors, map_stream_errors
from .score_wire import reservation_stats_to_pb
from .servicer_core import ServicerCore

__all__ = ["ObservingCalls"]


class ObservingCalls(ServicerCore):
    """GetStats, CheckPool, ListSessions, InspectPool and WatchEvents."""

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

    @map_stream_errors
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        service = self.registry.get(request.pool)
        journal = service.events
        fence = fence_to_pb(service.fence)
        cursor = request.after_sequence
        # Another history (restart, re-created pool, a restored data directory the
        # reader's fence proves, or a cursor this history never reached): start over
        # from the oldest kept event, flagged as a reset.
        other = request.HasField("fence") and (
            await self._proves_restore(request.fence)
            or not service.knows_instance(request.fence.instance_id)
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
            if items:  # the position these events are durable at (its records committed)
                self.mutations.positioned_fence(fence)
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

    async def _proves_restore(self, told: pb.Fence) -> bool:
        """True when a reader's fence proves the data directory was restored (positions.py:
        its position, with its tag, names a record of an earlier instance the journal does
        not hold), once the fencing that follows is durable (as before a call is told
        INSTANCE_CHANGED: the reader drops that fence on its reset). What it read after the
        copy was made belongs to a lost history; the events numbered after its cursor now
        are another history's, never its continuation.

        Raises:
            ServiceError: as :meth:`JournalPositions.prove` but INSTANCE_CHANGED (a made-up
                position: FENCE_UNPROVEN), or what the fencing raised.
        """
        if not told.position:
            return False
        registry = self.registry
        fence = fence_from_pb(told, True)
        assert fence is not None
        try:
            registry.positions.prove(fence, registry.instance_id, registry.lineage)
        except ServiceError as exc:
            if exc.reason is not ErrorReason.INSTANCE_CHANGED:
                raise
            await self.restore_fenced()
            return True
        return False
