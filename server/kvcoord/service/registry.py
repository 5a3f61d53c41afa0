"""Named pools, each with its engine instance, event journal and idempotency cache.

All handlers run on one asyncio event loop and call the engine inline (engine calls
never await), so every pool is linearizable: operations run one at a time, in the
order they arrive.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import re

import grpc
from kvcoord.engine import KVCacheConfig, KVCachePool
from kvcoord.v1 import allocator_pb2 as pb

from .convert import config_from_pb, event_to_pb
from .errors import ServiceError
from .events import EventJournal

__all__ = ["Limits", "PoolHandle", "PoolRegistry"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Server limits; exceeding one is RESOURCE_EXHAUSTED."""

    max_pools: int = 64
    max_blocks_per_pool: int = 50_000_000
    max_requests_per_pool: int = 1_000_000
    max_ops_per_step: int = 65_536
    event_buffer: int = 65_536
    idempotency_cache: int = 4_096


class PoolHandle:
    """One named pool and what the service keeps beside its engine."""

    def __init__(
        self, name: str, config_pb: pb.PoolConfig, config: KVCacheConfig, epoch: int, limits: Limits
    ) -> None:
        self.name = name
        self.config_pb = config_pb
        self.config = config
        self.engine = KVCachePool(config)
        self.epoch = epoch
        self.limits = limits
        self.events = EventJournal(limits.event_buffer)
        # request id -> owning session id (requests created without a session are absent)
        self.owners: dict[str, str] = {}
        self._responses: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.hash_settings = (config_pb.hash_algo, config_pb.hash_block_size, config_pb.hash_seed)

    def publish_events(self) -> int:
        """Move the engine's queued events into the journal."""
        events = self.engine.take_events()
        if not events:
            return 0
        return self.events.publish(event_to_pb(e) for e in events)

    def cached_response(self, key: str) -> bytes | None:
        if not key:
            return None
        return self._responses.get(key)

    def remember_response(self, key: str, response: bytes) -> None:
        if not key:
            return
        self._responses[key] = response
        self._responses.move_to_end(key)
        while len(self._responses) > self.limits.idempotency_cache:
            self._responses.popitem(last=False)

    def info(self) -> pb.PoolInfo:
        e = self.engine
        return pb.PoolInfo(
            name=self.name,
            config=self.config_pb,
            coordinator=self.config.coordinator_kind,
            num_free_blocks=e.num_free_blocks,
            usage=e.usage,
            num_requests=len(e.requests),
            epoch=self.epoch,
        )


class PoolRegistry:
    """The server's pools by name."""

    def __init__(self, limits: Limits, epoch: int = 1) -> None:
        self.limits = limits
        self.epoch = epoch
        self.pools: dict[str, PoolHandle] = {}

    def create(self, name: str, config_pb: pb.PoolConfig) -> tuple[PoolHandle, bool]:
        """Create a pool, or return the identical existing one (``created`` False).

        Raises:
            ServiceError: bad name, ALREADY_EXISTS with another config, or a limit.
            ConfigError: the layout is invalid.
        """
        if not _NAME.match(name):
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pool name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'",
            )
        existing = self.pools.get(name)
        if existing is not None:
            if existing.config_pb == config_pb:
                return existing, False
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"pool {name!r} already exists with a different configuration; delete it first "
                "or use another name",
            )
        if len(self.pools) >= self.limits.max_pools:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server already holds {len(self.pools)} pools (max_pools)",
            )
        if config_pb.num_blocks > self.limits.max_blocks_per_pool:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"num_blocks {config_pb.num_blocks} exceeds max_blocks_per_pool {self.limits.max_blocks_per_pool}",
            )
        config = config_from_pb(config_pb)
        handle = PoolHandle(name, config_pb, config, self.epoch, self.limits)
        self.pools[name] = handle
        # A pool is millions of long-lived objects: keep them out of the cyclic GC's
        # full passes, which would otherwise stall every call for hundreds of ms.
        gc.collect()
        gc.freeze()
        logger.info("created pool %s (%s blocks, %s)", name, config.num_blocks, config.coordinator_kind)
        return handle, True

    def get(self, name: str) -> PoolHandle:
        handle = self.pools.get(name)
        if handle is None:
            known = ", ".join(sorted(self.pools)) or "none"
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"pool {name!r} does not exist (pools: {known})")
        return handle

    def delete(self, name: str) -> PoolHandle:
        handle = self.get(name)
        del self.pools[name]
        handle.events.close()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        logger.info("deleted pool %s", name)
        return handle
