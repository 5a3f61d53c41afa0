"""How a clustered replica's registry and its ``Replicas`` RPCs see the cluster: the
registry's :class:`~kvcoord.service.registry.Placement` made of :class:`Ownership`'s rules
and :class:`~kvcoord.service.cluster.Cluster`'s claims (creating, deleting, adopting a
pool handed over), and the servicer of the replicas' own service, which only translates."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import cbor2
import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from .access import AccessControl
from .cluster import Cluster
from .errors import ErrorReason, ServiceError, Status, map_errors
from .handover_parts import accepted, assemble, check_header
from .ownership import check_addressed, replica_name
from .registry import Placement, PoolRegistry
from .tasks import CallCancelled, uncancelled

__all__ = ["ClusterPlacement", "ReplicasServicer"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def store_failed(exc: BaseException) -> bool:
    """``exc`` is a failure of a call to the cluster store itself (etcd did not answer
    in time, the connection failed, etcd answered an error), not one of this code: its
    outcome may be unknown (a DEADLINE_EXCEEDED may follow a commit)."""
    from aetcd import exceptions  # type: ignore[import-untyped]  # the "cluster" extra (a cluster runs it)

    return isinstance(exc, (exceptions.ClientError, grpc.aio.AioRpcError, TimeoutError, ConnectionError))


def _never() -> bool:
    return False


async def _in_call(call: Awaitable[T], pool: str, what: str, stopped: Callable[[], bool] = _never) -> T:
    """A store call made inside a client's call (a gRPC handler). A cancellation the
    handler was not asked for (the replica replaced its store client and closed the old
    one under the call: :func:`.tasks.uncancelled`) is answered UNAVAILABLE, which the
    client retries (was: the raw CancelledError ended the handler with no status sent:
    the client waited out its deadline, DEADLINE_EXCEEDED); so is a store call that
    failed (:func:`store_failed`: a timeout, a connection error; was: INTERNAL, which a
    client cannot tell from a bug, and whose outcome it took for known). Neither names a
    reason: the client takes the outcome of a mutation so answered for unknown
    (OutcomeUnknownError). ``what`` tells the caller what the call was doing (and what
    its outcome may be). Any other exception (a bug here) is raised as it is: INTERNAL.
    Once ``stopped()`` (the replica's cluster stopped under the call: its client closed)
    the answer says so: the client goes to another replica.

    Raises:
        ServiceError: UNAVAILABLE when the store call was cancelled under the handler
            or failed.
    """
    try:
        return await uncancelled(call)
    except Exception as exc:
        cancelled = isinstance(exc, CallCancelled)
        if not cancelled and not store_failed(exc):
            raise
        if stopped():
            why = "this replica is stopping (its cluster store client is closed): retry, another replica answers"
        elif cancelled:
            why = "the cluster store call was cancelled under it (its store client was replaced): retry"
        else:
            why = f"the cluster store call failed ({type(exc).__name__}: {str(exc)[:200]}): retry"
        raise ServiceError(Status.UNAVAILABLE, f"pool {pool[:200]!r}: {what}: {why}") from None


class ClusterPlacement(Placement):
    """A clustered replica's :class:`~kvcoord.service.registry.Placement`: the
    rules of :class:`Ownership`, with claims made through :class:`Cluster`."""

    def __init__(self, cluster: Cluster, registry: PoolRegistry) -> None:
        self.cluster = cluster
        self.registry = registry
        self.replica_id = cluster.me.replica_id
        self.name = replica_name(cluster.view.cluster, cluster.me.replica_id)

    def _stopped(self) -> bool:
        """The cluster stopped (its store client closed): a store call's failure says so."""
        return self.cluster.stopped

    def refuse_adopting(self, pool: str, from_replica: str, claim_revision: int) -> None:
        """Raise unless ``pool`` may be adopted here now (placement, claim, stopping)."""
        cluster = self.cluster
        if not cluster.view.may_adopt(pool, from_replica):
            raise ServiceError(
                Status.PRECONDITION,
                f"placement does not put pool {pool[:200]!r} on replica {cluster.me.replica_id!r} "
                f"(without {from_replica!r}): not adopted",
            )
        held = cluster.view.claims.get(pool)
        if held is not None and held.replica_id == cluster.me.replica_id:
            # a late copy of an earlier handover's call: the pool served here is the latest
            # (was: replaced by the state sent, then removed when the swap failed; with
            # local journals its only state, acknowledged allocations included, was gone)
            raise ServiceError(
                Status.PRECONDITION,
                f"replica {cluster.me.replica_id!r} holds the claim of pool {pool[:200]!r} (term {held.term}), "
                f"not {from_replica[:200]!r} at revision {claim_revision}: not adopted",
            )
        if cluster.stopping:
            raise ServiceError(Status.UNAVAILABLE, f"replica {cluster.me.replica_id!r} is leaving")

    async def adopt(self, pool: str, state: bytes, from_replica: str, claim_revision: int) -> int:
        """The new owner's side of a handover: load, journal, wait until durable, swap
        the claim, serve. Nothing is kept when the swap fails. Refused, nothing touched,
        when this replica holds the pool's claim (a late copy of an earlier call).

        The state is decoded and its engine built off the loop (pool_load.py: on the loop
        a large pool's held it for seconds); meanwhile the pool is not here, and its
        calls here are sent to its claim's holder, as before (the claim is swapped only
        once the pool is loaded and durable). Then the rules are checked again and the
        pool loaded at once."""
        from .pool_load import loaded_apart
        from .registry_state import adopt_leases, adopt_pool

        cluster, registry = self.cluster, self.registry
        self.refuse_adopting(pool, from_replica, claim_revision)
        if pool in cluster.adopting:
            raise ServiceError(Status.ABORTED, f"pool {pool[:200]!r} is being adopted already")
        cluster.adopting.add(pool)
        try:
            ready = None
            try:
                ready = await loaded_apart(state, None, registry.limits.max_tokens_per_request)
                self.refuse_adopting(pool, from_replica, claim_revision)
                service = adopt_pool(registry, ready.value, ready.built)
                adopt_leases(service, ready.value)  # (a replay of the journal's adopt record does not)
                # records of an earlier instance of this journal the pool holds and this
                # journal does not (killed between its two commits, the pool rebuilt from the
                # store by another replica since): held now, for this start and the next
                brought = registry.positions.brought(service.held)
                registry.recorder.adopted(ready.value, service, brought, ready.encoded)
            except (ValueError, KeyError, TypeError, cbor2.CBORDecodeError) as exc:
                raise ServiceError(
                    Status.INVALID,
                    f"the handed-over state of pool {pool[:200]!r} cannot be loaded: {exc}",
                ) from None
            finally:
                if ready is not None:
                    ready.let_go(registry.pools.get(pool))
                    del ready
            await registry.recorder.durable()
            claim = await _in_call(  # (a swap of unknown outcome: the watch settles the copy here)
                cluster.take_over(pool, from_replica, claim_revision),
                pool,
                "its claim may or may not be swapped",
                self._stopped,
            )
            if claim is None:
                registry.remove(pool)
                await registry.recorder.durable()
                raise ServiceError(
                    Status.PRECONDITION,
                    f"the claim of pool {pool[:200]!r} is no longer revision {claim_revision} of replica "
                    f"{from_replica!r}: not adopted",
                )
        finally:
            cluster.adopting.discard(pool)
        logger.info("adopted pool %s from replica %s (term %d)", pool, from_replica, claim.term)
        return claim.term

    def check(self, pool: str, local: bool) -> None:
        """:meth:`Ownership.check`; and with the journal in the store, a pool is served
        only once its stream is open here, and a pool of the catalog claimed here
        without its state here (a takeover whose read of the store failed, or whose
        claim's answer was lost) is never served: its history is in the store, so
        neither NOT_FOUND nor CreatePool making it again empty (recover_orphans gives
        the claim back at the next pass and takes the pool over again)."""
        cluster = self.cluster
        view = cluster.view
        view.check(pool, local)
        streams = cluster.streams
        if streams is None:
            return
        if local and not streams.is_open(pool):
            raise ServiceError(
                Status.UNAVAILABLE,
                f"pool {pool[:200]!r} is not journaled in the cluster store here yet: retry",
            )
        if not local and pool in view.catalog and view.holds(pool):
            raise ServiceError(
                Status.UNAVAILABLE,
                f"pool {pool[:200]!r} is claimed by replica {cluster.me.replica_id!r} but its state is not "
                "loaded here (taking it over from the cluster store failed): it is taken over again: retry here",
                ErrorReason.OWNER_CHANGING,
            )

    def serves(self, pool: str) -> bool:
        return self.cluster.view.holds(pool)

    def settled(self, pool: str) -> bool:
        """Held here and not being handed over: from the claim's swap to the handover's
        answer the copy here is the old owner's, and the new owner may have changed the
        pool since (was: scored from that copy, hits and free blocks it no longer had)."""
        view = self.cluster.view
        return view.holds(pool) and pool not in view.moving

    def term(self, pool: str) -> int:
        """The term of this replica's claim of ``pool`` (0: none held), whether or not the
        replica is sure of its lease at this moment: a pool made right after its claim,
        while that estimate lapsed for a moment, opens its stream in the store under the
        claim (whose writes the store refuses once the claim is gone). Was 0 then: no
        stream opened, and every call of the pool was told UNAVAILABLE until the watch's
        next pass, up to a lease later."""
        view = self.cluster.view
        claim = view.claims.get(pool)
        return claim.term if claim is not None and claim.replica_id == view.me.replica_id else 0

    async def before_create(self, pool: str) -> None:
        cluster, view = self.cluster, self.cluster.view
        if view.holds(pool):
            local = pool in self.registry.pools
            self.check(pool, local)  # not made again over its history
            if local:
                return
            # a claim held here of no pool here (a delete whose release in the store is of
            # unknown outcome, and may still land: it names this revision) is put again
            # first, under a new one (was: the pool made under it, and a late release
            # deleted its claim and catalog entry while it was served here)
            try:
                if await uncancelled(cluster.reclaim(pool, view.claims[pool].term)) is not None:
                    return
            except Exception as exc:
                if not isinstance(exc, CallCancelled) and not store_failed(exc):
                    raise
                raise ServiceError(
                    Status.UNAVAILABLE,
                    f"pool {pool[:200]!r}: its claim could not be put again: the cluster store did not "
                    f"answer ({type(exc).__name__}): retry",
                ) from None
            # no longer this replica's claim (the view was read again): as any unclaimed pool
        view.check(pool, local=False)
        try:
            claim = await uncancelled(cluster.claim(pool))  # (CallCancelled: UNAVAILABLE below)
        except Exception as exc:  # noqa: BLE001 - a slow or cut-off store: the caller retries
            # (was: INTERNAL, which no client retries). The claim may have been made:
            # the retry finds it this replica's, and makes the pool under it once
            # (or, seen first by the watch, it is given back: nothing was created)
            raise ServiceError(
                Status.UNAVAILABLE,
                f"pool {pool[:200]!r} could not be claimed: the cluster store did not answer ({exc!r}): retry",
            ) from None
        if claim is None:
            view.check(pool, local=False)  # the holder's redirect
            raise ServiceError(Status.UNAVAILABLE, f"pool {pool[:200]!r} could not be claimed: retry")

    async def before_delete(self, pool: str) -> None:
        """With the journal in the store, the pool is forgotten in the cluster first
        (claim, catalog and journal, only while the claim is this replica's), so a
        delete is never half done: refused with the pool untouched (the claim went to
        another replica: a redirect there), or final before the pool is removed here.
        The pool is moving meanwhile: other calls of it are told to retry.

        A delete in the store whose outcome is unknown (its answer lost: etcd may have
        made it), or refused (not this replica's claim), is settled by reading the
        store: a pool neither claimed nor in the catalog there no longer exists in the
        cluster (this delete was made, or an earlier one whose answer was lost), and the
        copy here goes now (was: kept and served, from a claim the store no longer had,
        until the watch's next pass; a retried DeletePool was told OWNER_CHANGING)."""
        cluster = self.cluster
        if cluster.streams is None:
            return
        view = cluster.view
        view.check(pool, local=True)
        view.moving.add(pool)
        try:
            unknown: ServiceError | None = None
            try:
                if await _in_call(
                    cluster.forget(pool),
                    pool,
                    "its delete in the cluster store may or may not be made",
                    self._stopped,
                ):
                    return
            except ServiceError as exc:  # (UNAVAILABLE: the outcome is unknown)
                unknown = exc
            try:
                await uncancelled(cluster.refresh())
            except Exception as exc:  # noqa: BLE001 - the claim is unknown: the caller retries
                if unknown is not None:
                    raise unknown from None
                raise ServiceError(
                    Status.UNAVAILABLE,
                    f"pool {pool[:200]!r} is not this replica's in the cluster store any more, and the store "
                    f"cannot be read: retry (nothing was deleted): {exc}",
                ) from None
            if pool not in view.claims and pool not in view.catalog:
                logger.warning("pool %s is deleted in the cluster store: its copy here is removed", pool)
                return  # deleted in the cluster: removed here by the caller
            if unknown is not None:  # still claimed (a delete of this one may yet land: unknown)
                raise unknown
        finally:
            view.moving.discard(pool)
        view.check(pool, local=True)  # another holder: the redirect there
        raise ServiceError(
            Status.UNAVAILABLE,
            f"pool {pool[:200]!r} is not this replica's in the cluster store any more: retry (nothing "
            "was deleted)",
        )

    async def after_delete(self, pool: str) -> None:
        if self.cluster.streams is None:  # else before_delete did it
            await _in_call(
                self.cluster.forget(pool),
                pool,
                "deleted here; its claim may or may not be released",
                self._stopped,
            )

    async def delete_unserved(self, pool: str, incarnation: int = 0) -> bool:
        """A pool of the catalog nobody claims (its owner stopped without handing it
        over), placed here: with the journal in the store, its history is there and is
        deleted there (whoever claims it later finds no journal: it does not exist);
        with local journals its state is on its owner's disk only, and it would come
        back with its owner: refused, OWNER_GONE, nothing deleted.

        With local journals, a pool claimed here of which nothing is here is left by a
        delete here whose release in the store failed (after_delete; or a CreatePool
        whose pool was never made): its state is nowhere, and its claim and catalog
        entry are released now; the usual rules then answer (NOT_FOUND). Was: kept,
        every DeletePool NOT_FOUND; once this replica restarted, the pool was one of the
        catalog nobody claims, OWNER_CHANGING, and its DeletePool OWNER_GONE, for good.

        A delete naming an ``incarnation`` (0: any) is not carried out in the store: the
        incarnation is in the pool's journal, which nobody has read; the usual rules
        answer (OWNER_CHANGING) until a replica rebuilt it and can check it."""
        cluster, view = self.cluster, self.cluster.view
        if (
            cluster.streams is None
            and pool not in self.registry.pools
            and view.holds(pool)
            and pool not in view.moving
            and pool not in cluster.adopting
        ):
            view.moving.add(pool)
            try:
                await _in_call(
                    cluster.forget(pool),
                    pool,
                    "its release in the cluster store may or may not be made",
                    self._stopped,
                )
            finally:
                view.moving.discard(pool)
            return False
        if (
            pool in self.registry.pools
            or pool not in view.catalog
            or pool in view.claims
            or pool in view.moving
            or pool in cluster.adopting
            or not view.lease_valid
            or not view.placed_here(pool)
        ):
            return False
        if cluster.streams is None:
            raise ServiceError(
                Status.PRECONDITION,
                f"pool {pool[:200]!r} was not deleted: its owner stopped without handing it over and its "
                'state is on that replica\'s disk only ([cluster] journal = "local"); start that replica '
                "again (it serves the pool again), then delete it",
                ErrorReason.OWNER_GONE,
            )
        if incarnation:
            return False
        view.moving.add(pool)  # not rebuilt here meanwhile (recover)
        try:
            return await _in_call(
                cluster.delete_unclaimed(pool),
                pool,
                "its delete in the cluster store may or may not be made",
                self._stopped,
            )
        finally:
            view.moving.discard(pool)


class ReplicasServicer(pb_grpc.ReplicasServicer):
    """The ``Replicas`` service: only translates (the rules are the placement's)."""

    def __init__(
        self, placement: ClusterPlacement, access: AccessControl, created: Callable[[str], None]
    ) -> None:
        self.placement = placement
        self.access = access
        self.created = created

    def between_replicas(self, context: grpc.aio.ServicerContext, call: str) -> None:
        """Refuse ``call`` unless it is meant for this replica (the one it names, if any:
        ownership.check_addressed) and its caller holds a full-access token (another
        replica).

        Raises:
            ServiceError: UNAVAILABLE (WRONG_REPLICA), PERMISSION_DENIED.
        """
        metadata = context.invocation_metadata() or ()
        check_addressed(metadata, self.placement.name)
        caller = self.access.authenticate(metadata, context.auth_context)
        if not caller.full_access:
            raise ServiceError(Status.DENIED, f"{call} is between replicas: it needs a full-access token")

    @map_errors
    async def AdoptPool(
        self, request: pb.AdoptPoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdoptPoolResponse:
        self.between_replicas(context, "AdoptPool")
        term = await self.placement.adopt(
            request.pool, request.state, request.from_replica, request.claim_revision
        )
        self.created(request.pool)
        return pb.AdoptPoolResponse(term=term)

    @map_errors
    async def AdoptPoolParts(
        self, parts: AsyncIterator[pb.AdoptPoolPart], context: grpc.aio.ServicerContext
    ) -> pb.AdoptPoolResponse:
        """AdoptPool with the state in parts (handover_parts.py): the header is checked
        (and whether the pool may be adopted here, before its pieces are read), the
        pieces assembled and checked, then the pool adopted as AdoptPool's. A stream cut
        or refused on the way adopts nothing."""
        self.between_replicas(context, "AdoptPoolParts")
        first = await anext(aiter(parts), None)
        header = check_header(first, self.placement.cluster.max_message_bytes)
        self.placement.refuse_adopting(header.pool, header.from_replica, header.claim_revision)
        await accepted(context)  # (the caller sends the pieces only now)
        state = await assemble(parts, header)
        term = await self.placement.adopt(header.pool, state, header.from_replica, header.claim_revision)
        self.created(header.pool)
        return pb.AdoptPoolResponse(term=term)
