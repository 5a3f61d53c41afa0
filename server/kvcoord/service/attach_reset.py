"""An Attach that resets the pool's prefix cache (AttachRequest.reset_prefix_cache).

A pool's block ids are slots of one engine's KV memory, and a cached block's hash is
a promise that its slot holds that prefix's KV. An engine whose memory holds none of
the pool's cache (a new process), or other KV than the server's state says (a session
attached again after a loss: its worker wrote blocks in Steps the server never
applied, or a schedule() call cut by the loss cached blocks never computed), asks its
Attach to reset the cache as the session starts, so nothing reads it before: the
session's cursors start after the reset, and the journal's ``attach`` record carries
it (replayed the same way: one record, so no snapshot falls between the two).
"""

from __future__ import annotations

from typing import Protocol

from kvcoord.engine.reservations import Reservations

from .errors import ErrorReason, ServiceError, Status
from .sessions import Session, SessionTable

__all__ = [
    "Resettable",
    "check_outside_holder",
    "check_resettable",
    "reset_for_new_engine",
]


class Resettable(Protocol):
    """What this module reads and does of a :class:`~.pool_service.PoolService` (it
    imports nothing of pool_service.py, which calls it)."""

    name: str
    sessions: SessionTable

    @property
    def num_requests(self) -> int: ...

    @property
    def reservations(self) -> Reservations: ...

    def release_reservation(self, reservation_id: str) -> bool: ...

    def reset_prefix_cache(self) -> bool: ...


def check_resettable(service: Resettable) -> None:
    """Refuse an Attach with reset_prefix_cache whose reset the pool's users would not
    all want (checked before the session is made: nothing changed when refused).

    The cache is every attached session's, so no other session may be attached (an
    exclusive Attach is refused for them anyway); a request of no live session holds
    blocks, so the cache could not be reset (as ResetPrefixCache is refused then).

    Raises:
        ServiceError: FAILED_PRECONDITION (POOL_EXCLUSIVE) naming which.
    """
    if service.sessions.of_pool(service.name):
        raise ServiceError(
            Status.PRECONDITION,
            f"pool {service.name!r} has other sessions: its prefix cache is theirs too, so it cannot be "
            "reset for a new engine; attach once they end",
            ErrorReason.POOL_EXCLUSIVE,
        )
    if service.num_requests:
        raise ServiceError(
            Status.PRECONDITION,
            f"pool {service.name!r} holds {service.num_requests} request(s) of no live session: its "
            "prefix cache cannot be reset for a new engine; attach once they are freed",
            ErrorReason.POOL_EXCLUSIVE,
        )


#: why a call other than the exclusive session's is refused, by call: its client answers
#: from its own copy of the pool (PredictingKVCacheManager's mirror)
OUTSIDE_HOLDER = {
    # a reset it did not make leaves the mirror believing hashes the pool forgot (its hits
    # refused a backlog late, every request lost); the session resets through its own Step
    # (ResetPrefixCacheOp) or names itself
    "reset": "a reset it did not make would void its answers; reset through that session, or once it ends",
    # its worker may run a backlog of steps on block ids the deletion voids before a Step's
    # failure tells it; the session may delete its pool itself, an operator forces the call
    "delete": "deleting the pool under it would void the block ids its worker is using; delete once it "
    "ends, from that session, or with force",
}


def check_outside_holder(service: Resettable, session_id: str, tenant: str, call: str) -> None:
    """Refuse a ResetPrefixCache or (unforced) DeletePool ``call`` ("reset", "delete")
    that does not come from the pool's exclusive session while there is one
    (:data:`OUTSIDE_HOLDER` says why).

    Raises:
        ServiceError: FAILED_PRECONDITION (POOL_EXCLUSIVE) naming the session (its
            client to its own tenant only).
    """
    why = OUTSIDE_HOLDER[call]
    holder = next((o for o in service.sessions.of_pool(service.name) if o.exclusive), None)
    if holder is None or holder.session_id == session_id:
        return
    whose = (
        f"({holder.client_name!r}, session {holder.session_id[:12]}...)"
        if holder.tenant == tenant
        else ("of another tenant")
    )
    raise ServiceError(
        Status.PRECONDITION,
        f"pool {service.name!r} has an exclusive session {whose} that may answer from its own copy of the "
        f"pool: {why}",
        ErrorReason.POOL_EXCLUSIVE,
    )


def reset_for_new_engine(service: Resettable, s: Session) -> None:
    """Reset the pool's prefix cache as session ``s`` (just opened, its cursors not yet
    set) starts: the Attach, and its replay. Routers' reservations are released first
    (as when their time runs out): their hits are KV the engine's memory does not hold,
    which the request adopting one would read.

    Raises:
        ServiceError: INTERNAL (``s`` closed) when a block is still held after
            :func:`check_resettable` passed: never expected.
    """
    for reservation_id in list(service.reservations.live):
        service.release_reservation(reservation_id)
    if not service.reset_prefix_cache():
        service.sessions.close(s.session_id)
        raise ServiceError(
            Status.INTERNAL,
            f"pool {service.name!r} still holds blocks with no session, request or reservation: its prefix "
            "cache was not reset and no session was made",
        )
