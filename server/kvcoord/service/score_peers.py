"""ScorePools in a cluster: the replica a call reaches answers for every pool of the
cluster, as one server holding them all would.

Each replica serves its own pools, so the replica that receives a ScorePools call
(:class:`ClusterScores`) scores the pools it serves itself and asks each other pool's
owner, in parallel, for its part (``Replicas.ScoreForTenant``: the same request for the
caller's tenant, its candidates that owner's pools, no reservation). The callee scores
only pools it serves (:class:`ScoringReplicas`), with its own access rules and the
tenant's cache namespace, and never asks onward. The parts are merged in the policy's
order (longest hit, most free blocks, name: ``PoolScore.rank``). A pool whose owner does
not answer within :data:`PEER_SCORE_SECONDS` (and half of what is left of the call's
deadline), or that nobody serves at the moment (its owner died, it is being handed
over), is listed in ``unscored`` with reason :data:`UNSCORED_UNREACHABLE`: the answer is
bounded, never held by one frozen replica, and never silently short of a pool.

With ``reserve_seconds`` the best pool of the merged answer is reserved on its owner: a
second call there naming it alone, under the caller's idempotency key (kept apart from
the caller's own calls: RoutingCalls._part_key_owner), so exactly one reservation is
made, and a keyed retry reaching any replica that picks the same pool gets the same
one; the replica that asked keeps the pool under the key before it asks (the caller's
RoutingCalls._choice_key_owner), so a retry reaching it asks that pool again, whatever
the scores say then. Its fresh score replaces the one read before.

What a tenant sees is decided as for a single server: the observe role, by pool name
(every replica holds the same tenants), is checked here for every pool of the cluster
before any is asked for, and again by each owner for its own pools.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from kvcoord.wire import score_rank

from .access import FULL_ACCESS, AccessControl, Role, Tenant
from .cluster import Cluster
from .cluster_placement import ClusterPlacement, ReplicasServicer
from .durability import Recorder
from .errors import REASON_METADATA_KEY, ErrorReason, ServiceError, Status, map_errors

__all__ = ["PEER_SCORE_SECONDS", "UNSCORED_UNREACHABLE", "ClusterScores", "ScoringReplicas"]

#: the longest wait for another owner's scores (seconds); at most half of what is left
#: of the caller's deadline too
PEER_SCORE_SECONDS = 2.0
#: UnscoredPool.reason of a pool whose owner could not be asked in time (it did not
#: answer, or nobody serves the pool at the moment)
UNSCORED_UNREACHABLE = "OWNER_UNREACHABLE"

#: a reservation's journal record, written before the answer waits until durable (None: none)
Record = Callable[[Recorder], None] | None
#: scores a request over this replica's own pools, as a message, answered once durable
#: (with reserve_seconds it reserves, keeps the answer under its key and journals):
#: RoutingCalls.score_here
ScoreHere = Callable[[Tenant, pb.ScorePoolsRequest], Awaitable[pb.ScorePoolsResponse]]
#: the same without the wait: the answer and its record (RoutingCalls.scored_here)
ScoredHere = Callable[[Tenant, pb.ScorePoolsRequest], tuple[pb.ScorePoolsResponse, Record]]

_STATUSES = {
    grpc.StatusCode.INVALID_ARGUMENT: Status.INVALID,
    grpc.StatusCode.NOT_FOUND: Status.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED: Status.DENIED,
    grpc.StatusCode.FAILED_PRECONDITION: Status.PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status.EXHAUSTED,
    grpc.StatusCode.ABORTED: Status.ABORTED,
}


def _part(request: pb.ScorePoolsRequest, pools: Sequence[str], reserve: bool) -> pb.ScorePoolsRequest:
    """``request`` with ``pools`` as its candidates (with its reservation and key, or without)."""
    part = pb.ScorePoolsRequest()
    part.CopyFrom(request)
    del part.candidate_pools[:]
    part.candidate_pools.extend(pools)
    if not reserve:
        part.reserve_seconds = 0.0
        part.idempotency_key = ""
    return part


def _unreachable(pools: Sequence[str], why: str) -> list[pb.UnscoredPool]:
    return [pb.UnscoredPool(pool=p, reason=UNSCORED_UNREACHABLE, message=why) for p in pools]


def _told(exc: grpc.aio.AioRpcError) -> ServiceError | None:
    """The peer's answer as this replica's own error, when it is one a single server
    would have given (a wrong request, a refusal); None: the peer was not reached (or
    failed otherwise: its pools are unscored)."""
    status = _STATUSES.get(exc.code())
    if status is None:
        return None
    reason = None
    for key, value in exc.trailing_metadata() or ():
        if key == REASON_METADATA_KEY:
            reason = ErrorReason.__members__.get(value if isinstance(value, str) else value.decode())
    if reason in (ErrorReason.NOT_OWNER, ErrorReason.OWNER_CHANGING, ErrorReason.OWNER_GONE):
        return None
    return ServiceError(status, exc.details() or "", reason)


class ClusterScores:
    """The fan-out of a ScorePools call over the cluster (see the module's docstring).

    Args:
        cluster: this replica's cluster (its view: claims, catalog, members).
        access: the tenants' roles.
        served: the pools this replica serves now (``PoolRegistry.served``).
    """

    def __init__(self, cluster: Cluster, access: AccessControl, served: Callable[[], Sequence[str]]) -> None:
        self.cluster = cluster
        self.access = access
        self.served = served
        #: address -> an open channel to that replica (kept: one per routing call is slow)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def plan(
        self, tenant: Tenant, candidates: Sequence[str]
    ) -> tuple[list[str], dict[str, list[str]], list[pb.UnscoredPool]]:
        """Where each pool to score is: served here, by owner address elsewhere, or by
        nobody at the moment (unscored).

        Raises:
            ServiceError: UNAVAILABLE (this replica's lease may have ended: its view of
                the cluster cannot be trusted), INVALID_ARGUMENT (a candidate named
                twice), PERMISSION_DENIED / NOT_FOUND (a candidate the caller may not
                observe / that does not exist in the cluster).
        """
        view = self.cluster.view
        me = view.me.replica_id
        _lease_held(self.cluster)
        here = set(self.served())
        if candidates:
            if len(set(candidates)) != len(candidates):
                twice = sorted({c for c in candidates if candidates.count(c) > 1})
                raise ServiceError(Status.INVALID, f"candidate_pools names {twice[0][:128]!r} more than once")
            for name in candidates:
                if not self.access.holds(tenant, Role.OBSERVE, name):
                    raise ServiceError(
                        Status.DENIED,
                        f"the caller lacks the observe role on pool {name[:128]!r} (ScorePools needs it)",
                    )
                if name not in here and name not in view.claims and name not in view.catalog:
                    raise ServiceError(
                        Status.NOT_FOUND,
                        f"pool {name[:200]!r} does not exist (ListPools shows the pools you may use)",
                    )
            names: Sequence[str] = candidates
        else:
            every = here | set(view.claims) | view.catalog
            names = sorted(n for n in every if self.access.holds(tenant, Role.OBSERVE, n))
        local: list[str] = []
        remote: dict[str, list[str]] = {}
        nobody: list[str] = []
        for name in names:
            claim = view.claims.get(name)
            if name in here:
                local.append(name)
            elif claim is not None and claim.replica_id != me and claim.replica_id in view.members:
                remote.setdefault(claim.address, []).append(name)
            else:
                nobody.append(name)
        lost = _unreachable(
            nobody,
            "no live replica serves the pool at the moment (its owner stopped, or it is changing owner): "
            "score again shortly",
        )
        return local, remote, lost

    async def score(
        self,
        tenant: Tenant,
        request: pb.ScorePoolsRequest,
        plan: tuple[list[str], dict[str, list[str]], list[pb.UnscoredPool]],
        here: ScoredHere,
        time_remaining: float | None,
        chosen: str = "",
        choose: Callable[[str], None] = lambda _pool: None,
    ) -> tuple[pb.ScorePoolsResponse, Record]:
        """The merged answer of every part of ``plan`` (:meth:`plan`), and with
        ``reserve_seconds`` the reservation of its best pool on that pool's owner; with
        the journal record of a reservation made here (the caller writes it, keeps the
        answer under the caller's key and answers once durable). ``choose`` is told the
        pool before its owner is asked to reserve it (the caller keeps it under the key);
        ``chosen``: the pool an earlier try of the call asked for, reserved again whatever
        the scores say now (its owner answers from its kept part: one reservation).

        Raises:
            ServiceError: what a single server raises for the request (a part's
                INVALID_ARGUMENT, the reservation's refusals); UNAVAILABLE when the best
                pool's owner cannot be reached for its reservation (its outcome is
                unknown: retry with the same idempotency key), or the pool ``chosen``
                was not scored now.
        """
        local, remote, lost = plan
        loop = asyncio.get_running_loop()
        deadline = None if time_remaining is None else loop.time() + time_remaining
        wait = PEER_SCORE_SECONDS if time_remaining is None else min(PEER_SCORE_SECONDS, time_remaining / 2)
        asked = [
            loop.create_task(self._ask(address, tenant, _part(request, pools, False), wait, pools))
            for address, pools in remote.items()
        ]
        try:
            if asked:
                await asyncio.sleep(0)  # the owners' calls sent first: this replica's part meanwhile
            parts = [self._here_now(tenant, _part(request, local, False), here)[0]] if local else []
            parts.extend(await asyncio.gather(*asked))
        finally:
            for task in asked:
                task.cancel()
        scores = sorted((s for p in parts for s in p.scores), key=score_rank)
        unscored = [*lost, *(u for p in parts for u in p.unscored)]
        answer = pb.ScorePoolsResponse()
        record: Record = None
        if request.reserve_seconds:
            at = _chosen_at(scores, chosen)
            if not chosen and (not scores or not scores[0].hit_tokens):
                answer.reservation_skipped = (
                    "no pool was scored" if not scores else f"the best pool {scores[0].pool!r} has no hit"
                )
            else:
                best = scores.pop(at)
                ask = _part(request, [best.pool], True)
                if best.pool in local:  # (kept under the key as a part, as an owner keeps it)
                    held, record = self._here_now(tenant, ask, here)
                else:
                    choose(best.pool)
                    left = PEER_SCORE_SECONDS if deadline is None else deadline - loop.time()
                    held = await self._reserve_at(
                        remote, best.pool, tenant, ask, min(PEER_SCORE_SECONDS, left)
                    )
                scores = sorted([*scores, *held.scores], key=score_rank)
                unscored.extend(held.unscored)
                if held.HasField("reservation"):
                    answer.reservation.CopyFrom(held.reservation)
                else:
                    answer.reservation_skipped = (
                        held.reservation_skipped or f"the best pool {best.pool!r} moved"
                    )
        answer.scores.extend(scores)
        answer.unscored.extend(sorted(unscored, key=lambda u: u.pool))
        return answer, record

    def _here_now(
        self, tenant: Tenant, part: pb.ScorePoolsRequest, here: ScoredHere
    ) -> tuple[pb.ScorePoolsResponse, Record]:
        """``here`` over the candidates of ``part`` this replica still serves, the others
        unscored as an owner names them: the call awaited since its plan (a turn of the
        loop; the other owners' parts before a reservation), and a pool may have begun
        changing owner meanwhile (was: NOT_FOUND, "does not exist", for a pool handed over,
        or for every pool once the lease lapsed).

        Raises:
            ServiceError: UNAVAILABLE when this replica's lease may have ended meanwhile.
        """
        _lease_held(self.cluster, during=True)
        ask, moved = _split(part, self.served(), self.cluster.me.replica_id)
        answer, record = (None, None) if ask is None else here(tenant, ask)
        return _with_moved(answer, part, moved), record

    async def _ask(
        self, address: str, tenant: Tenant, part: pb.ScorePoolsRequest, wait: float, pools: Sequence[str]
    ) -> pb.ScorePoolsResponse:
        """One owner's part; its pools unscored when it does not answer within ``wait``."""
        try:
            return await self._call(address, tenant, part, wait)
        except grpc.aio.AioRpcError as exc:
            told = _told(exc)
            if told is not None:
                raise told from None
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # it answered: it cannot score for others
                why = (
                    f"the pool's owner at {address} runs an earlier kvcoord release, without "
                    "Replicas.ScoreForTenant (a rolling upgrade): its pools are scored by the replica reached "
                    "once that owner is upgraded; until then ScorePools sent to it scores them"
                )
                return pb.ScorePoolsResponse(unscored=_unreachable(pools, why))
            why = f"{exc.code().name}: {(exc.details() or '')[:200]}"
        except (TimeoutError, OSError) as exc:
            why = type(exc).__name__
        return pb.ScorePoolsResponse(
            unscored=_unreachable(
                pools,
                f"the pool's owner at {address} did not answer within {wait:.2f} s ({why}): score again shortly",
            )
        )

    async def _reserve_at(
        self, remote: dict[str, list[str]], pool: str, tenant: Tenant, part: pb.ScorePoolsRequest, wait: float
    ) -> pb.ScorePoolsResponse:
        address = next(a for a, pools in remote.items() if pool in pools)
        try:
            return await self._call(address, tenant, part, max(0.0, wait))
        except grpc.aio.AioRpcError as exc:
            told = _told(exc)
            if told is not None:
                raise told from None
            raise ServiceError(
                Status.UNAVAILABLE,
                f"the reservation in pool {pool[:200]!r} at its owner {address} may or may not be made "
                f"({exc.code().name}): retry with the same idempotency key",
            ) from None

    async def _call(
        self, address: str, tenant: Tenant, part: pb.ScorePoolsRequest, wait: float
    ) -> pb.ScorePoolsResponse:
        channel = self._channels.get(address)
        if channel is None:
            members = {m.address for m in self.cluster.view.members.values()}
            for gone in [a for a in self._channels if a not in members]:
                await self._channels.pop(gone).close()
            channel = self._channels[address] = self.cluster.peer_channel(address)
        stub = pb_grpc.ReplicasStub(channel)  # type: ignore[no-untyped-call]
        named = next((m.replica_id for m in self.cluster.view.members.values() if m.address == address), "")
        answer: pb.ScorePoolsResponse = await stub.ScoreForTenant(
            pb.ScoreForTenantRequest(tenant=tenant.name, request=part),
            timeout=wait,
            metadata=self.cluster.metadata_for(named) if named else self.cluster.peer_metadata,
        )
        return answer

    async def close(self) -> None:
        """Close the channels to other replicas."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


class ScoringReplicas(ReplicasServicer):
    """The ``Replicas`` service with ``ScoreForTenant`` (the callee's side of
    :class:`ClusterScores`)."""

    def __init__(
        self,
        placement: ClusterPlacement,
        access: AccessControl,
        created: Callable[[str], None],
        served: Callable[[], Sequence[str]],
        score_here: ScoreHere,
    ) -> None:
        super().__init__(placement, access, created)
        self.served = served
        self.score_here = score_here

    @map_errors
    async def ScoreForTenant(
        self, request: pb.ScoreForTenantRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScorePoolsResponse:
        self.between_replicas(context, "ScoreForTenant")
        tenant = FULL_ACCESS if not request.tenant else self.access.tenants.get(request.tenant)
        if tenant is None:
            raise ServiceError(
                Status.DENIED,
                f"tenant {request.tenant[:128]!r} is not configured on replica "
                f"{self.placement.replica_id!r} (every replica must hold the same tenants)",
            )
        part = request.request
        self.access.authorize(tenant, "ScorePools", part)  # the observe role on each candidate
        # (served() is empty once the lease may have ended: every candidate unscored)
        ask, moved = _split(part, self.served(), self.placement.replica_id)
        return _with_moved(None if ask is None else await self.score_here(tenant, ask), part, moved)


def _chosen_at(scores: Sequence[pb.PoolScore], chosen: str) -> int:
    """Where the pool ``chosen`` is among ``scores`` (0 when none was chosen).

    Raises:
        ServiceError: UNAVAILABLE when it is not scored now (its owner did not answer).
    """
    if not chosen:
        return 0
    at = next((i for i, s in enumerate(scores) if s.pool == chosen), None)
    if at is None:
        raise ServiceError(
            Status.UNAVAILABLE,
            f"an earlier try of this call asked pool {chosen[:200]!r} for its reservation, which may or may "
            "not be made, and the pool is not scored now (its owner did not answer): retry with the same "
            "idempotency key",
        )
    return at


def _lease_held(cluster: Cluster, during: bool = False) -> None:
    """Raises:
    ServiceError: UNAVAILABLE when this replica's lease may have ended (its view of the
        cluster cannot be trusted: it scores no pool, its own included); ``during``:
        since the call began (it was planned under a valid lease).
    """
    if not cluster.view.lease_valid:
        when = "its membership lease may have ended during the call" if during else "its lease is not renewed"
        raise ServiceError(
            Status.UNAVAILABLE,
            f"replica {cluster.me.replica_id!r} cannot reach the cluster store ({when}): it scores and "
            "reserves no pool until its membership lease is renewed (retry; another replica answers)",
        )


def _split(
    part: pb.ScorePoolsRequest, served: Sequence[str], me: str
) -> tuple[pb.ScorePoolsRequest | None, list[pb.UnscoredPool]]:
    """``part`` narrowed to the candidates this replica serves now, unchanging (None:
    none), and the others unscored (handed over, or being handed over: the copy here may
    not be the pool's any more)."""
    now = set(served)
    mine = [p for p in part.candidate_pools if p in now]
    moved = _unreachable(
        [p for p in part.candidate_pools if p not in now],
        f"replica {me!r} no longer serves the pool (it is changing owner): score again shortly",
    )
    return (_part(part, mine, True) if mine else None), moved


def _with_moved(
    answer: pb.ScorePoolsResponse | None, part: pb.ScorePoolsRequest, moved: list[pb.UnscoredPool]
) -> pb.ScorePoolsResponse:
    """The answer of :func:`_split`'s narrowed part (None: nothing was asked) with the
    pools it left out named unscored."""
    if answer is None:
        answer = pb.ScorePoolsResponse()
        if part.reserve_seconds:
            answer.reservation_skipped = "the best pool is no longer served by its owner"
    if moved:
        unscored = sorted([*answer.unscored, *moved], key=lambda u: u.pool)
        del answer.unscored[:]
        answer.unscored.extend(unscored)
    return answer
