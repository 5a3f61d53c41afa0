"""What the parts of a pool's service (pool_requests.py, pool_steps.py, ...) read of the
:class:`~.pool_service.PoolService` that owns them, as a protocol: they import nothing of
pool_service.py, which builds them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvcoord.engine import KVCacheConfig, KVCachePool

from .events import EventJournal
from .fences import Fence
from .pool_types import HashSettings, Limits, ScoreSettings
from .sessions import Session, SessionTable


class PoolCore(Protocol):
    """What a part of a pool's service (pool_requests.py, pool_steps.py, ...) reads of
    the :class:`~.pool_service.PoolService` that owns it: the pool's state, read afresh
    at each use (``engine`` is replaced by an imported state, ``owners`` by a restore)."""

    name: str
    config: KVCacheConfig
    hash_settings: HashSettings
    score_settings: ScoreSettings
    fence: Fence
    limits: Limits
    sessions: SessionTable
    #: the clock of the restart grace (pool_service.py)
    grace_clock: Callable[[], float]
    engine: KVCachePool
    events: EventJournal
    owners: dict[str, Session]
    answer_event_bytes: int | None

    def cache_namespace(self, tenant: str) -> str: ...

    def reset_prefix_cache(self) -> bool: ...
