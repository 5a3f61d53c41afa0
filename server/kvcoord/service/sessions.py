"""Worker sessions: leases, request ownership and per-session cursors.

A session belongs to one pool incarnation. It owns the requests it registered; when
its lease runs out (or it detaches) those requests are freed. Each session also has
its own event cursor and prefix-cache statistics, so every worker sees what vLLM's
own manager would show it. Plain Python; the clock is injected.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable

from kvcoord.engine import PrefixCacheStats

from .errors import ErrorReason, ServiceError, Status
from .stalls import lease_outlasts_stalls, lease_rule, min_lease_seconds

__all__ = ["Session", "SessionTable", "attach_tail"]


@dataclasses.dataclass(slots=True, eq=False)
class Session:
    session_id: str
    pool: str
    client_name: str
    lease_seconds: float
    expires_at: float
    #: request ids this session registered and has not freed, in registration order
    owned: dict[str, None] = dataclasses.field(default_factory=dict)
    #: last event sequence number this session took (TakeEvents)
    events_cursor: int = 0
    #: this session's prefix-cache statistics since its last make_prefix_cache_stats
    stats: PrefixCacheStats | None = None
    #: the pool's only session (see AttachRequest.exclusive)
    exclusive: bool = False
    #: the tenant that attached it ("" = full access); only it may use the session
    tenant: str = ""
    #: the prefix-cache namespace of its requests (derived from tenant and pool)
    cache_namespace: str = ""
    #: the client's key of the Attach that made it (AttachRequest.attach_key; "": none)
    attach_key: str = ""
    #: its Attach reset the pool's prefix cache (AttachRequest.reset_prefix_cache): a
    #: retry's answer says so too
    reset_at_attach: bool = False


def attach_tail(s: Session) -> tuple[str | bool, ...]:
    """The optional last values of a session's record (journal ``attach``, snapshot):
    its attach key when it has one or its Attach reset the prefix cache, and then
    ``True`` when it did (records before the reset flag have at most the key)."""
    if s.reset_at_attach:
        return (s.attach_key, True)
    return (s.attach_key,) if s.attach_key else ()


class SessionTable:
    """Live sessions by id, for every pool of a server.

    Args:
        clock: monotonic seconds; a server's lease clock (lease_clock.py) leaves out
            its pauses, so a lease runs in the time the server could read renewals.
        default_lease: the lease when a client asks for none.
        max_lease: the longest lease granted (longer requests are capped).
    """

    def __init__(self, clock: Callable[[], float], default_lease: float, max_lease: float) -> None:
        self.clock = clock
        self.default_lease = default_lease
        self.max_lease = max_lease
        self.sessions: dict[str, Session] = {}
        #: called with every session whose lease is granted or renewed (lease marker)
        self.on_lease: Callable[[Session], None] | None = None
        #: a lease asked for below the default must outlast this stall bound (seconds;
        #: None: any lease): that of a server whose durable writes can stall (server.py)
        self.stall_bound: float | None = None
        #: given every session :meth:`get` finds run out but not reaped, taken out of the
        #: table, to end it as the reaper would (the registry's: journaled as expired);
        #: None: left to the reaper
        self.on_lapsed: Callable[[Session], None] | None = None

    def open(self, pool: str, client_name: str, lease_seconds: float) -> Session:
        """A new session with a lease starting now."""
        if not math.isfinite(lease_seconds) or lease_seconds < 0:
            raise ServiceError(
                Status.INVALID,
                f"lease_seconds must be a finite number >= 0, got {lease_seconds}",
            )
        lease = min(lease_seconds or self.default_lease, self.max_lease)
        bound = self.stall_bound
        if lease < self.default_lease and bound is not None and not lease_outlasts_stalls(lease, bound):
            # a durable write stalled that long is waited for, not failed: the session's
            # calls would be answered after its lease, and a worker lose its requests (or
            # keep blocks its server freed, were its lease not counted) over a tolerated stall
            raise ServiceError(
                Status.INVALID,
                f"lease_seconds {lease:g} is too short for this server: a lease below its default "
                f"({self.default_lease:g} s) must be long enough that {lease_rule(bound)}; ask for "
                f"more than {min_lease_seconds(bound):g} s, or 0 for the default",
            )
        s = Session(secrets.token_hex(16), pool, client_name[:256], lease, self.clock() + lease)
        if self.on_lease is not None:
            self.on_lease(s)
        self.sessions[s.session_id] = s
        return s

    def get(self, session_id: str, pool: str | None = None) -> Session:
        """The live session (not renewed). One whose lease ran out but which the reaper did
        not end yet is ended first (:attr:`on_lapsed`): a caller told SESSION_EXPIRED ("its
        requests were freed") must not see it come back after a crash.

        Raises:
            ServiceError: INVALID_ARGUMENT without an id; NOT_FOUND (SESSION_EXPIRED)
                for an unknown or expired one; PERMISSION_DENIED for another pool's.
        """
        if not session_id:
            raise ServiceError(
                Status.INVALID,
                "session_id is required: call Attach first (requests must belong to a session, so "
                "that a dead worker's blocks are freed)",
            )
        s = self.sessions.get(session_id)  # (one lookup and one clock read: every keyed call)
        if s is not None and s.expires_at <= self.clock():
            if self.on_lapsed is not None:
                del self.sessions[session_id]
                self.on_lapsed(s)
            s = None
        if s is None:
            raise ServiceError(
                Status.NOT_FOUND,
                f"session {session_id[:64]!r} is unknown or its lease ran out (its requests were "
                "freed); call Attach again and treat every request of the old session as lost",
                ErrorReason.SESSION_EXPIRED,
            )
        if pool is not None and s.pool != pool:
            raise ServiceError(
                Status.DENIED,
                f"session {session_id[:64]!r} is attached to pool {s.pool!r}, not {pool!r}",
            )
        return s

    def renew(self, s: Session) -> None:
        """Extend the lease from now (every successful call of the session does)."""
        if self.on_lease is not None:
            self.on_lease(s)
        s.expires_at = self.clock() + s.lease_seconds

    def close(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def expired(self, pool: str | None = None) -> list[Session]:
        """Remove and return every session whose lease ran out (only ``pool``'s when given)."""
        now = self.clock()
        dead = [s for s in self.sessions.values() if s.expires_at <= now and pool in (None, s.pool)]
        for s in dead:
            del self.sessions[s.session_id]
        return dead

    def ran_out(self, session_id: str) -> Session | None:
        """Remove and return the session when its lease ran out (None: unknown or live)."""
        s = self.sessions.get(session_id)
        if s is None or s.expires_at > self.clock():
            return None
        del self.sessions[session_id]
        return s

    def attached_with(self, pool: str, tenant: str, key: str) -> Session | None:
        """The live session of ``pool`` that ``tenant`` attached with ``key`` (None
        without a key, or when there is none)."""
        if not key:
            return None
        now = self.clock()
        for s in self.sessions.values():
            if s.attach_key == key and s.pool == pool and s.tenant == tenant and s.expires_at > now:
                return s
        return None

    def count_of_tenant(self, tenant: str) -> int:
        """Live sessions of ``tenant`` (every pool)."""
        return sum(1 for s in self.sessions.values() if s.tenant == tenant)

    def of_pool(self, pool: str) -> list[Session]:
        return [s for s in self.sessions.values() if s.pool == pool]

    def listing(self, pool: str) -> list[tuple[Session, float]]:
        """The live sessions of ``pool`` in id order, each with the seconds left on its
        lease (0 or less: run out, not yet reaped). Renews nothing."""
        now = self.clock()
        return [(s, s.expires_at - now) for s in sorted(self.of_pool(pool), key=lambda s: s.session_id)]
