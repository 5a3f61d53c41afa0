"""A pool's reservations (ScorePools with reserve_seconds): a router holds a prompt's hit
for a while, a request's first allocation adopts the oldest one made for its prompt,
and one that runs out is released. The engine holds the blocks; this part keeps who
holds each reservation and until when. A part of :class:`~.pool_service.PoolService`
(its ``reserving``), reached through it."""

from __future__ import annotations

from collections.abc import Sequence

from kvcoord.engine import CacheHit

from .errors import ErrorReason, ServiceError, Status
from .pool_core import PoolCore
from .pool_types import ReservationLease


class PoolReservations:
    """The leases of one pool's reservations (:class:`~.pool_service.PoolService`
    forwards to these)."""

    def __init__(self, pool: PoolCore) -> None:
        self.pool = pool
        #: live reservations' holders and deadlines (the engine holds the blocks); a
        #: reservation the engine holds without one here (recovered) is expired
        self.leases: dict[str, ReservationLease] = {}

    def reserve(
        self, reservation_id: str, hashes: Sequence[bytes], num_tokens: int, tenant: str, seconds: float
    ) -> CacheHit:
        """Hold ``tenant``'s hit of this prompt for ``seconds`` (engine ``reserve``); an
        empty hit holds nothing. The caller checks limits and journals it.

        Raises:
            ServiceError: FAILED_PRECONDITION when an exclusive session holds the pool
                (its client predicts every allocation: a held block would break that).
        """
        if any(o.exclusive for o in self.pool.sessions.of_pool(self.pool.name)):
            raise ServiceError(
                Status.PRECONDITION,
                f"pool {self.pool.name!r} has an exclusive session, which predicts every allocation: "
                "it cannot hold reservations",
                ErrorReason.POOL_EXCLUSIVE,
            )
        hit = self.pool.engine.reserve(reservation_id, hashes, num_tokens, self.pool.cache_namespace(tenant))
        if hit.num_tokens:
            self.leases[reservation_id] = ReservationLease(tenant, self.pool.sessions.clock() + seconds)
        return hit

    def expired_reservations(self) -> list[str]:
        """Live reservations whose time ran out (or whose lease was lost in a restart)."""
        now = self.pool.sessions.clock()
        leases = self.leases
        return [
            rid
            for rid in self.pool.engine.reservations.live
            if (lease := leases.get(rid)) is None or lease.deadline <= now
        ]

    def release_reservation(self, reservation_id: str) -> bool:
        """Release a reservation no request adopted (expiry; also a journal replay)."""
        self.leases.pop(reservation_id, None)
        return self.pool.engine.release_reservation(reservation_id)

    def reservations_of(self, tenant: str) -> int:
        return sum(1 for lease in self.leases.values() if lease.tenant == tenant)

    def adopt(self, rid: str, got_tokens: int) -> None:
        """Request ``rid``, just allocated with a hit of ``got_tokens``, adopts the oldest
        reservation made for its prompt (engine ``adopt_reservation``), whose lease ends."""
        r = self.pool.engine.adopt_reservation(rid, got_tokens)
        if r is not None:
            self.leases.pop(r.reservation_id, None)

    def replay_reserve(
        self, reservation_id: str, hashes: Sequence[bytes], num_tokens: int, tenant: str
    ) -> None:
        """Hold a journaled reservation again, with no lease (recovery releases it at once:
        :meth:`expired_reservations`)."""
        self.pool.engine.reserve(reservation_id, hashes, num_tokens, self.pool.cache_namespace(tenant))
