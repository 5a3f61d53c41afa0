"""The Allocator's pool administration calls: CreatePool, GetPool, ListPools,
DeletePool (its blocks released a slice at a time afterwards) and ResetPrefixCache."""

from __future__ import annotations

import asyncio

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from .access import current_tenant
from .attach_reset import check_outside_holder
from .errors import ErrorReason, ServiceError, Status, map_errors
from .pool_service import PoolService
from .servicer_core import ServicerCore, fence_of

__all__ = ["PoolCalls", "check_incarnation"]


def check_incarnation(service: PoolService, incarnation: int) -> None:
    """A DeletePool naming ``incarnation`` (0: any) deletes only that one: the pool
    may have been deleted and made again since its caller learnt it (a retry after a
    lost answer), and the one there now is not the caller's to delete.

    Raises:
        ServiceError: FAILED_PRECONDITION (INCARNATION_CHANGED), nothing deleted.
    """
    if incarnation and incarnation != service.fence.incarnation:
        raise ServiceError(
            Status.PRECONDITION,
            f"pool {service.name[:200]!r} is incarnation {service.fence.incarnation}, not {incarnation} "
            "(that one was deleted and the pool made again since, or it never was this pool's): nothing "
            "was deleted",
            ErrorReason.INCARNATION_CHANGED,
        )


class PoolCalls(ServicerCore):
    """CreatePool, GetPool, ListPools, DeletePool and ResetPrefixCache."""

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
        if await registry.placement.delete_unserved(request.name, request.incarnation):  # nobody served it
            return pb.DeletePoolResponse()
        registry.get(request.name)  # NOT_FOUND, or the owner's redirect, before anything changes
        # The pool is held from its checks to its removal (a Step applied to it in slices
        # ends first): no call of it runs in between. Checked, then awaited, an exclusive
        # Attach landing meanwhile got a session of the pool deleted after it.
        await registry.locks.acquire(request.name)
        try:
            service = registry.get(request.name)  # (deleted or moved meanwhile: NOT_FOUND, redirect)
            check_incarnation(service, request.incarnation)
            if request.session_id:
                service.session(request.session_id, None)  # a live session of this pool (NOT_FOUND)
            if not request.force:  # an exclusive session's worker may be running on its own copy
                check_outside_holder(service, request.session_id, current_tenant().name, "delete")
            # In a store-journal cluster the pool is gone from the cluster after this (so
            # it is no longer claimed here: removed without the placement check again).
            await registry.placement.before_delete(request.name)
            if request.name not in registry.pools:
                registry.get(request.name)  # removed otherwise meanwhile: NOT_FOUND
            service = registry.remove(request.name)
        finally:
            registry.locks.give(request.name)
        self.observer.pool_deleted(service)
        await self.registry.placement.after_delete(request.name)
        return await self._durable(pb.DeletePoolResponse())

    async def teardowns_done(self) -> None:
        """Return once every deleted pool's sliced teardown has finished."""
        while self._teardowns:
            await asyncio.gather(*self._teardowns)

    @map_errors
    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        service = self.registry.get(request.pool)
        service.check_fence(fence_of(request))
        if request.session_id:
            service.session(request.session_id, None)
        check_outside_holder(service, request.session_id, current_tenant().name, "reset")
        result = service.reset_prefix_cache()
        return await self._durable(
            pb.ResetPrefixCacheResponse(result=result, num_free_blocks=service.num_free_blocks),
            lambda r: r.prefix_cache_reset(service),
        )
