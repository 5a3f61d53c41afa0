"""What the servicer tells about pool lifecycle, sessions and Steps (the metrics
collector listens): :class:`OperationObserver`, and :class:`NullObserver`, which ignores
everything."""

from __future__ import annotations

from typing import Protocol

from .pool_service import PoolService

__all__ = ["NullObserver", "OperationObserver"]


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
