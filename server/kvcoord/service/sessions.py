"""Worker sessions: leases that free a dead worker's requests."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

import grpc

from .errors import ServiceError

__all__ = ["Session", "SessionManager"]


@dataclasses.dataclass(slots=True)
class Session:
    session_id: str
    pool: str
    client_name: str
    lease_seconds: float
    expires_at: float


class SessionManager:
    """Sessions by id. The clock is injected so tests need no sleeping."""

    def __init__(self, clock: Callable[[], float], default_lease: float, max_lease: float) -> None:
        self.clock = clock
        self.default_lease = default_lease
        self.max_lease = max_lease
        self.sessions: dict[str, Session] = {}

    def open(self, pool: str, client_name: str, lease_seconds: float) -> Session:
        lease = min(lease_seconds or self.default_lease, self.max_lease)
        s = Session(secrets.token_hex(16), pool, client_name, lease, self.clock() + lease)
        self.sessions[s.session_id] = s
        return s

    def touch(self, session_id: str, pool: str | None = None) -> Session:
        """Renew and return a live session.

        Raises:
            ServiceError: NOT_FOUND for an unknown or expired session,
                PERMISSION_DENIED for a session of another pool.
        """
        s = self.sessions.get(session_id)
        if s is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"session {session_id!r} is unknown or expired (its requests were freed); call Attach again",
            )
        if pool is not None and s.pool != pool:
            raise ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"session {session_id!r} is attached to pool {s.pool!r}, not {pool!r}",
            )
        s.expires_at = self.clock() + s.lease_seconds
        return s

    def close(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def expired(self) -> list[Session]:
        """Remove and return every session whose lease ran out."""
        now = self.clock()
        dead = [s for s in self.sessions.values() if s.expires_at <= now]
        for s in dead:
            del self.sessions[s.session_id]
        return dead
