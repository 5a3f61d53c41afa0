"""The Allocator's routing call, ScorePools (scores, best first; a reservation kept
under its idempotency key without a journal record), and the expiry of reservations."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from .access import Role, Tenant, current_tenant
from .durability import Recorder
from .errors import map_errors
from .idempotency import score_key_owner
from .score_wire import prompts_from_pb, reservation_to_pb, scores_to_pb
from .scoring import Reserve, score_pools
from .servicer_core import ServicerCore

if TYPE_CHECKING:  # pragma: no cover
    from .score_peers import ClusterScores

__all__ = ["RoutingCalls"]

#: a call's journal record, written before its answer waits until durable (None: none)
Record = Callable[[Recorder], None] | None


class RoutingCalls(ServicerCore):
    """ScorePools and the expiry of its reservations."""

    #: a cluster replica's fan-out over the other owners (server_cluster.py; None: a single node)
    score_peers: ClusterScores | None = None

    @map_errors
    async def ScorePools(
        self, request: pb.ScorePoolsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScorePoolsResponse | bytes:
        """Scores, best first; without block ids or a reservation, as the encoded bytes
        of the answer (:class:`~kvcoord.service.score_wire.ScoreEncoder`). A cluster
        replica answers for every pool of the cluster (:mod:`.score_peers`)."""
        tenant = current_tenant()
        peers = self.score_peers
        if peers is None:
            return await self._score_here(tenant, request)
        plan = peers.plan(tenant, list(request.candidate_pools))
        _, remote, lost = plan
        if not remote and not lost and not request.reserve_seconds:  # every pool is here: as a single node
            return await self._score_here(tenant, request)
        digest = b""
        chosen = ""  # the pool an earlier try of this key asked its owner to reserve ("": none)
        if request.reserve_seconds and request.idempotency_key:
            digest, kept = self.mutations.kept_unjournaled(
                score_key_owner(tenant.name), "ScorePools", request, pb.ScorePoolsResponse
            )
            if kept is not None:  # a retry: the first answer, nothing reserved again
                return await self._durable(kept)
            _, choice = self.mutations.kept_unjournaled(
                _choice_key_owner(tenant), "ScorePools", request, pb.ScorePoolsResponse
            )
            chosen = "" if choice is None else choice.reservation.pool

        def choose(pool: str) -> None:
            # kept before the owner is asked (its answer may be lost): a retry asks that
            # owner again, whose kept part answers it (was: scored again, and the first
            # reservation's held blocks, no longer free, could rank another pool first,
            # reserved too)
            if digest and not chosen:
                choice = pb.ScorePoolsResponse(reservation=pb.Reservation(pool=pool))
                self.mutations.keep_unjournaled(
                    _choice_key_owner(tenant), "ScorePools", request, digest, choice
                )

        response, record = await peers.score(
            tenant, request, plan, self.scored_here, context.time_remaining(), chosen, choose
        )
        if digest and response.HasField("reservation"):
            # kept before the wait (as a single node's): a retry after a cancel or a
            # lost answer gets this reservation, never a second one
            self.mutations.keep_unjournaled(
                score_key_owner(tenant.name), "ScorePools", request, digest, response
            )
        return await self._durable(response, record)

    async def score_here(self, tenant: Tenant, request: pb.ScorePoolsRequest) -> pb.ScorePoolsResponse:
        """ScorePools for ``tenant`` over the pools this server serves, as a message,
        answered once durable (an owner's part of a cluster's call: :mod:`.score_peers`)."""
        answer, durable, record = self._scored_here(tenant, request, True, _part_key_owner(tenant))
        assert isinstance(answer, pb.ScorePoolsResponse)
        return await self._durable(answer, record) if durable else answer

    def scored_here(
        self, tenant: Tenant, request: pb.ScorePoolsRequest
    ) -> tuple[pb.ScorePoolsResponse, Record]:
        """:meth:`score_here` without its wait: the answer and its reservation's journal
        record (``None``: none), for the caller to answer with once durable (the
        receiving replica's own part of a cluster's call, unkeyed: it keeps the answer)."""
        answer, _, record = self._scored_here(tenant, request, True, _part_key_owner(tenant))
        assert isinstance(answer, pb.ScorePoolsResponse)
        return answer, record

    async def _score_here(
        self, tenant: Tenant, request: pb.ScorePoolsRequest
    ) -> pb.ScorePoolsResponse | bytes:
        answer, durable, record = self._scored_here(tenant, request, False)
        if not durable:
            return answer
        assert isinstance(answer, pb.ScorePoolsResponse)  # (bytes only without a wait)
        return await self._durable(answer, record)

    def _scored_here(
        self, tenant: Tenant, request: pb.ScorePoolsRequest, message: bool, key_owner: str = ""
    ) -> tuple[pb.ScorePoolsResponse | bytes, bool, Record]:
        """ScorePools over the pools this server serves (``message``: never as bytes):
        the answer, whether it is sent only once durable, and the journal record to
        write first (a reservation's). ``key_owner``: whose the key is (default: the
        caller's tenant's, :func:`score_key_owner`)."""
        key_owner = key_owner or score_key_owner(tenant.name)
        limits = self.registry.limits
        reserve = None
        digest = b""  # a reserving call's key's digest (none: no key)
        if request.reserve_seconds:
            reserve = Reserve(
                request.reserve_seconds,
                lambda pool: self.access.holds(tenant, Role.USE, pool),
                limits.max_reservation_seconds,
                limits.max_reservations_per_tenant,
                lambda pool: self.registry.placement.check(pool, True),
            )
            if request.idempotency_key:
                digest, kept = self.mutations.kept_unjournaled(
                    key_owner, "ScorePools", request, pb.ScorePoolsResponse
                )
                if kept is not None:  # a retry: the first answer, nothing reserved again
                    return kept, True, None
        scores = score_pools(
            self.registry.settled(),  # (a cluster's pool changing owner: unscored, score_peers.py)
            # full access holds every role: no check per pool (64 pools: about 30 us)
            _everywhere if tenant.full_access else lambda pool: self.access.holds(tenant, Role.OBSERVE, pool),
            list(request.candidate_pools),
            request.num_tokens,
            prompts_from_pb(request.prompts),
            tenant.name,
            reserve,
            # hit lengths alone through the cross-pool index unless block ids are asked for
            None if request.include_block_ids else self.registry.score_index,
        )
        if reserve is None and not request.include_block_ids and not message:
            # a router's usual call: the answer's bytes joined from parts kept per pool
            # (add_servicer sends them as they are)
            return self._score_encoder.encode(scores.scores, scores.unscored), False, None
        response = scores_to_pb(scores.scores, scores.unscored, request.include_block_ids)
        made = scores.reservation
        if made is None:
            response.reservation_skipped = scores.reservation_skipped
            return response, False, None
        response.reservation.CopyFrom(reservation_to_pb(made))
        if digest:
            self.mutations.keep_unjournaled(key_owner, "ScorePools", request, digest, response)
        held = self.registry.pools[made.pool]
        return (
            response,
            True,
            lambda r: r.reserved(held, made.reservation_id, made.num_tokens, made.hashes, made.tenant),
        )

    def expire_reservations(self) -> int:
        """Release every reservation whose time ran out (journaled); how many."""
        if self.journal_failure is not None:
            return 0
        n = 0
        for service in list(self.registry.pools.values()):
            if self.registry.locks.busy(service.name):
                continue  # mid-Step: the next round releases them
            for reservation_id in service.expired_reservations():
                service.release_reservation(reservation_id)
                # called at once, inside the loop: the loop variables are the current ones
                self.mutations.record(lambda r: r.reservation_released(service, reservation_id))  # noqa: B023
                n += 1
        return n


def _part_key_owner(tenant: Tenant) -> str:
    """Whose the key of a cluster's part of a ScorePools call is (its reservation, made
    on the best pool's owner, named alone under the caller's key): apart from the
    caller's own calls under that key, whose body differs (a retry reaching this replica
    finds the caller's call new here, and its reservation part kept). Unjournaled like
    :func:`score_key_owner` (it starts alike); no tenant name holds a NUL."""
    return score_key_owner(tenant.name) + "\x00part"


def _choice_key_owner(tenant: Tenant) -> str:
    """Whose the key is under which a cluster's reserving ScorePools keeps the pool it asks
    another owner to reserve, until that owner answers (unjournaled, apart from the
    caller's own answers under the key: :func:`_part_key_owner`)."""
    return score_key_owner(tenant.name) + "\x00choice"


def _everywhere(_pool: str) -> bool:
    """``AccessControl.holds`` for a full-access tenant: every role on every pool."""
    return True
