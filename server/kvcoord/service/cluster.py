"""What a replica does as its cluster changes (``[cluster]``): it follows the store
(a watch, and a lease it keeps alive), claims the pools it holds state of, takes over
the pools whose owner died (failover, with the journal in the store) and hands its
pools over when a member joins or it leaves. The calls to the store (membership,
claims, the catalog) are :mod:`.cluster_store`'s; the rules are :mod:`.ownership`'s.

**Handover.** When a member joins, each replica hands the pools placement now puts on
the joiner over to it (:meth:`Cluster.rebalance`, beside the watch); a replica leaving gracefully (SIGTERM) hands each of its pools
to placement over the others, all within server.grace_seconds (:meth:`Cluster.leave`).
The old owner stops serving the pool (calls are UNAVAILABLE: clients retry), sends its
state (registry_state.dump_pool: engine, events, sessions with cursors, kept answers,
lineage) with ``Replicas.AdoptPool`` (a state larger than one part: in parts, each
under max_message_bytes, with ``AdoptPoolParts``, handover_parts.py); the new owner
journals it (an ``adopt`` record) and waits until it is durable, then swaps the claim
to itself (compare-and-swap on the claim's revision) and serves; only then does the
old owner remove its copy (journaled). A failure at any step before the swap leaves the old owner serving, under
its claim put again first (:meth:`Cluster._settle_failed_handover`: a swap still on its
way can never land); after it, the new owner's journal has the state. The call is made as the replicas serve (``[server.tls]``: TLS, and a client certificate
under mutual TLS; ``[cluster.peer_tls]``, tls.py) with the first full-access token.
A failed handover is counted (kvcoord_handovers_failed) and tried again by a rebalance
only after a pause, growing (handover_parts.HandoverPauses); one that cannot happen as
the replicas are (a peer of an earlier release and a state too large for one message,
or a peer's lower max_message_bytes) is logged saying why, and paused longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from .cluster_recover import ClusterRecovery
from .cluster_store import ClusterError
from .cluster_watch import follow_changes
from .errors import REPLICA_METADATA_KEY
from .handover_parts import HandoverPauses, send_state
from .ownership import Claim, Member, replica_name
from .tasks import cancel_and_wait, uncancelled

__all__ = ["Cluster", "ClusterError"]

logger = logging.getLogger(__name__)

#: seconds a handover's AdoptPool call may take (at least the store timeout)
HANDOVER_SECONDS = 30.0
#: handovers at a time when a replica leaves or hands pools to a joiner
LEAVE_PARALLEL = 4


class Cluster(ClusterRecovery):
    """One replica in its cluster: its connection to the store (:class:`ClusterStore`,
    whose arguments it takes) and what it does as the cluster changes: claims,
    failover, handovers."""

    def __init__(
        self,
        endpoints: Iterable[str],
        name: str,
        me: Member,
        lease_seconds: int,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(endpoints, name, me, lease_seconds, timeout, clock)
        self._changed = asyncio.Event()
        #: the pools this replica holds state of (the registry's); set by the server
        self.local_pools: Callable[[], Iterable[str]] = list
        #: a pool's state for a handover (registry_state.dump_pool, CBOR; a large pool's
        #: encoded off the loop, state_export.py); set by the server
        self.export_pool: Callable[[str], Awaitable[bytes]] | None = None
        #: returns once no Step is applied to the pool in slices (pool_locks.py)
        self.pool_free: Callable[[str], Awaitable[None]] | None = None
        #: the end of a handover: the pool is removed here (journaled), if still held (on_lost
        #: removed it when the swap deposed a write of its journal); set by the server
        self.handed_over: Callable[[str], None] | None = None
        #: pools being adopted: held here, not claimed yet (claim_local leaves them be)
        self.adopting: set[str] = set()
        #: metadata of calls to other replicas (a full-access token, if the server has one)
        self.peer_metadata: tuple[tuple[str, str], ...] = ()
        #: TLS of calls to other replicas (tls.peer_credentials; None: plaintext)
        self.peer_tls: tuple[grpc.ChannelCredentials, list[tuple[str, str]]] | None = None
        #: remove the local copy of a pool (recorded locally, no redirect); set by the server
        self.drop_local: Callable[[str], None] | None = None
        #: a pool rebuilt from the store made ready to load, off the loop; set by the server
        self.prepare_pool: Callable[[dict[str, Any] | None, bytes | None], Awaitable[Any]] | None = None
        #: load a pool made ready under a new term, and wait until durable
        self.load_pool: Callable[[Any, int], Awaitable[None]] | None = None
        #: a fresh scratch registry whose instance is the given writer (rebuilding)
        self.scratch_registry: Callable[[str], Any] | None = None
        #: pools rebuilt from the store after their owner was gone (metrics, tests)
        self.failovers = 0
        #: seconds a graceful leave may take, its handovers included (server.grace_seconds)
        self.leave_seconds = HANDOVER_SECONDS
        #: pools whose rebuilding failed -> when to try again
        self._retry_at: dict[str, float] = {}
        #: the rebalance pass running beside the watch, if any
        self._rebalancing: asyncio.Task[None] | None = None
        #: this replica's server.max_message_bytes: a handover's state is sent in parts
        #: each under it (handover_parts.py); set by the server
        self.max_message_bytes = 16 * 1024 * 1024
        #: failed handovers, counted (metrics) and paused (a rebalance tries them later)
        self.handovers = HandoverPauses()
        #: pools whose handover failed and whose claim could not be put again yet ->
        #: the claim's revision the handover named (not served; tried at each pass)
        self._unsettled: dict[str, int] = {}

    # -- start ------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, register this replica under a fresh lease, read the view, claim
        the pools this replica holds state of, and keep all of it up to date.

        Raises:
            ClusterError: no endpoint answers, or another live process registered
                this replica id and its lease did not end within lease_seconds.
        """
        await self.connect()
        await self.register()
        # renewed from now on: rebuilding this replica's pools from the store (a large
        # pool's journal) may take longer than the lease
        self.tasks = [asyncio.get_running_loop().create_task(self._keep_alive())]
        await self.refresh()
        await self.claim_local()
        self.tasks.append(asyncio.get_running_loop().create_task(self._watch()))

    # -- claims -------------------------------------------------------------------------
    async def claim_local(self) -> None:
        """Settle first the handovers that failed while the store did not answer
        (:meth:`_settle_failed_handover`). Claim every pool this replica holds state of that nobody claims. A copy
        held here whose claim another replica holds was handed over (this replica
        stopped before removing it): it is removed. With the journal in the store, the
        store is the pool's history: a pool claimed again is rebuilt from it (the copy
        here may be behind what a later owner acknowledged). A pool held here and
        claimed here is told its claim's term (on_term: that of a claim whose answer
        was lost is learned here, at the next pass)."""
        for pool, revision in list(self._unsettled.items()):
            await self._settle_failed_handover(pool, revision, None)
        if not self.view.lease_valid:
            # (its lease may have ended: a claim made with it is refused "requested lease
            # not found" and logged as a pool not claimed; the keep-alive registers again
            # and claims these then)
            return
        local = [p for p in self.local_pools() if p not in self.adopting]
        for pool in self.view.should_claim(local):
            try:
                if self.streams is not None:
                    await self.recover(pool)
                else:
                    await self.claim(pool, own_copy=True)  # not a copy handed over since
            except Exception as exc:  # noqa: BLE001 - a slow store: claimed at the next pass
                # (the watch passes again at every change and every lease; was: raised
                # on, and at start the replica exited 1 while the store was slow)
                logger.error("pool %s could not be claimed (tried again within a lease): %r", pool, exc)
        for pool in local:
            holder = self.view.claims.get(pool)
            if self.on_term is not None and self.view.holds(pool) and pool not in self.view.moving:
                assert holder is not None
                self.on_term(pool, holder.term)  # a claim whose answer was lost: its term
            if (
                holder is not None
                and holder.replica_id != self.me.replica_id
                and pool not in self.view.moving
            ):
                logger.warning(
                    "pool %s is held here but replica %s holds its claim (it was handed over): the copy here "
                    "is removed", pool, holder.replica_id,
                )  # fmt: skip
                if self.handed_over is not None:
                    self.handed_over(pool)

    # -- failover (journal = "store") ----------------------------------------------------
    async def recover_orphans(self) -> None:
        """Claim and rebuild from the store every pool of the catalog nobody claims
        that placement puts here (its owner died or was cut off), and release claims
        held here of pools with no state here."""
        if self.streams is None or self.stopping:
            return
        view = self.view
        local = set(self.local_pools())
        for pool in view.owned():
            if pool not in local and pool not in self.adopting and pool not in view.moving:
                try:
                    await self.release(pool)
                except Exception as exc:  # noqa: BLE001 - given back at the next pass; never served meanwhile
                    logger.warning("pool %s: its claim could not be released (tried again): %r", pool, exc)
        now = self.clock()
        for pool in view.orphans():
            if self.stopping or not view.lease_valid:
                return
            if pool not in self.adopting and self._retry_at.get(pool, 0.0) <= now:
                await self.recover(pool)

    # -- handovers ----------------------------------------------------------------------
    async def rebalance(self) -> None:
        """Hand over every pool placement now puts on another member (one joined),
        :data:`LEAVE_PARALLEL` at a time, all within :data:`HANDOVER_SECONDS`: each
        call to the joiner ends by then (a pool whose handover failed is served here
        again), and a pool whose handover has not started by then stays here until
        the next pass. Run beside the watch (:meth:`_rebalance_beside`): was one pool
        at a time, up to 30 s each, inside it, and the watch followed nothing else
        meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(HANDOVER_SECONDS, self.timeout)
        gate = asyncio.Semaphore(LEAVE_PARALLEL)

        async def move(pool: str, target: Member) -> None:
            async with gate:
                if (
                    not self.stopping
                    and loop.time() < deadline
                    and not self.handovers.pausing(pool, target.replica_id, self.clock())
                ):
                    await self.hand_over(pool, target, deadline)

        moves = [loop.create_task(move(pool, target)) for pool, target in self.view.hand_overs().items()]
        if moves:  # each ends by itself: its call by the deadline, then a store call
            await asyncio.gather(*moves)

    def _rebalance_beside(self) -> None:
        """Start a rebalance pass unless one runs (the watch goes on meanwhile)."""
        running = self._rebalancing
        if (running is not None and not running.done()) or self.stopping or not self.view.hand_overs():
            return
        task = asyncio.get_running_loop().create_task(self.rebalance())
        task.add_done_callback(_logged)
        self._rebalancing = task
        self.tasks = [t for t in self.tasks if not t.done() and t is not running] + [task]

    async def leave(self) -> None:
        """A graceful stop: hand every pool over to placement over the other members
        (one without a live member to go to stays unclaimed until this one is back),
        :data:`LEAVE_PARALLEL` at a time, all within :attr:`leave_seconds`
        (server.grace_seconds). A handover still running then is cancelled, and its
        pool is not served here any more: the new owner has it if it swapped the claim
        already; else the claim goes with this replica's lease (stop), and with
        journal = "store" the replica placement names rebuilds the pool from the store
        (nothing acknowledged is lost: every answer waited for its record there); with
        "local" it stays unclaimed until this replica is back (its journal is here)."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.leave_seconds
        try:  # no other replica places a pool here from now on
            async with asyncio.timeout_at(deadline):
                await self.client.delete(self.key("members", self.me.replica_id))
        except Exception as exc:  # noqa: BLE001 - its lease still ends it
            logger.warning("leaving: the member key could not be deleted: %r", exc)
        gate = asyncio.Semaphore(LEAVE_PARALLEL)

        async def move(pool: str, target: Member) -> None:
            async with gate:
                await self.hand_over(pool, target, deadline)

        rebalancing = self._rebalancing
        if rebalancing is not None and not rebalancing.done():  # its handovers end within the grace too
            await asyncio.wait([rebalancing], timeout=max(0.0, deadline - loop.time()))
        moves = {loop.create_task(move(pool, target)): pool for pool, target in self.view.leaving().items()}
        if not moves:
            return
        _, late = await asyncio.wait(moves, timeout=max(0.0, deadline - loop.time()))
        await cancel_and_wait(moves)
        if late:
            logger.error(
                "leaving: %d pool(s) not handed over within %.1f s (server.grace_seconds), not served here "
                "any more; their claims end with this replica's lease: %s",
                len(late), self.leave_seconds, ", ".join(sorted(moves[t][:200] for t in late)),
            )  # fmt: skip

    async def hand_over(self, pool: str, target: Member, deadline: float | None = None) -> bool:
        """Move ``pool`` to ``target`` (see the module docstring); True once it has it.
        ``deadline`` (the loop's time) bounds the call to ``target`` (leave)."""
        view = self.view
        claim = view.claims.get(pool)
        if claim is None or claim.replica_id != self.me.replica_id or self.export_pool is None:
            return False
        if pool in view.moving:  # being handed over already (a member joined: rebalance)
            return False
        view.moving.add(pool)
        try:
            if self.pool_free is not None:  # a Step applied to it in slices ends first
                await self.pool_free(pool)
            state = await self.export_pool(pool)
            limit = max(HANDOVER_SECONDS, self.timeout)
            if deadline is not None:
                limit = min(limit, deadline - asyncio.get_running_loop().time())
            async with self.peer_channel(target.address) as channel:
                answer = await send_state(
                    channel,
                    pb.AdoptPoolHeader(pool=pool, from_replica=self.me.replica_id, claim_revision=claim.term),
                    state,
                    self.max_message_bytes,
                    limit,
                    self.metadata_for(target.replica_id),
                    f"{target.replica_id!r} at {target.address}",
                )
            del state  # (not held while the handover ends)
        except Exception as exc:  # noqa: BLE001 - the pool stays here, served again
            self.handovers.failed(pool, target.replica_id, exc, self.clock())
            await self._settle_failed_handover(pool, claim.term, exc)
            return False
        self.handovers.succeeded(pool)
        view.learned(pool, Claim(pool, target.replica_id, target.address, answer.term), answer.term)
        try:  # (the pool may be gone here already: the swap deposed a write of its journal, on_lost)
            if self.handed_over is not None:
                self.handed_over(pool)
        finally:  # the claim is the target's: calls go there (was: "changing owner" here for good)
            view.moving.discard(pool)
        logger.info(
            "handed pool %s over to replica %s at %s (term %d)",
            pool,
            target.replica_id,
            target.address,
            answer.term,
        )
        for fn in self.on_change:
            fn()
        return True

    def metadata_for(self, replica_id: str) -> tuple[tuple[str, str], ...]:
        """The metadata of a call to replica ``replica_id``: the full-access token, and
        the replica named (``kvcoord-replica``): a server that took a dead member's
        address over refuses it (WRONG_REPLICA) instead of adopting or scoring a pool of
        the same name."""
        return (*self.peer_metadata, (REPLICA_METADATA_KEY, replica_name(self.view.cluster, replica_id)))

    def peer_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to another replica: TLS when the replicas serve TLS ([server.tls])."""
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        if self.peer_tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        credentials, extra = self.peer_tls
        return grpc.aio.secure_channel(address, credentials, options=[*options, *extra])

    async def _settle_failed_handover(self, pool: str, revision: int, exc: BaseException | None) -> None:
        """After a handover that failed (``exc``; None: settled again at a later pass),
        the claim it named at ``revision``. The adopter may have swapped the claim and
        failed to answer; or its swap (compared on ``revision``) may still be on its
        way to the store, or be applied there after its caller gave up. So the pool is
        served here again only under its claim put again (:meth:`reclaim`: a new
        revision, on which no swap was ever compared): were it served under the old
        one, a late swap would land and the adopter would serve the state it was sent,
        without what was acknowledged here meanwhile (and hand those blocks out again).
        Another replica holds the claim: the swap landed, the new owner's journal has
        the state, the copy here is removed. The store does not answer: the pool stays
        unserved here (callers are told the owner is changing and retry) and this is
        tried again at the watch's next pass."""
        view = self.view
        try:  # (cancelled under this task: its client replaced and closed; was: "moving" for good)
            claim = await uncancelled(self.reclaim(pool, revision))
        except Exception as again:  # noqa: BLE001 - the claim is unknown: keep not serving
            self._unsettled[pool] = revision
            logger.error(
                "handing pool %s over failed (%s), and its claim cannot be put again (tried again at the next "
                "pass; not served meanwhile): %r", pool, exc, again,
            )  # fmt: skip
            return
        self._unsettled.pop(pool, None)
        holder = view.claims.get(pool) if claim is None else claim
        try:
            if holder is not None and holder.replica_id != self.me.replica_id:
                logger.warning(
                    "pool %s: the handover's answer was lost, but replica %s holds it", pool, holder.replica_id,
                )  # fmt: skip
                if self.handed_over is not None:
                    self.handed_over(pool)
            elif holder is None:  # this replica's lease ended meanwhile: claimed again (claim_local)
                logger.error("handing pool %s over failed, and its claim ended: %s", pool, exc)
            elif pool not in self.local_pools():  # given up here meanwhile (on_lost): no state to serve
                logger.error(
                    "handing pool %s over failed (%s), and it is not held here any more (its journal could not "
                    "be written to the store): its claim is released at the next pass", pool, exc,
                )  # fmt: skip
            else:
                if claim is None and self.on_term is not None:  # put again earlier, that answer lost
                    self.on_term(pool, holder.term)
                logger.error(
                    "handing pool %s over failed; it is served here again (term %d): %s", pool, holder.term, exc,
                )  # fmt: skip
        finally:  # settled: served here again, or redirected to the claim's holder
            view.moving.discard(pool)

    # -- background ---------------------------------------------------------------------
    async def _keep_alive(self) -> None:
        """Renew the lease every third of its time. A renewal that fails leaves the
        view's validity where the last success put it: past it, nothing is served. A
        lease etcd no longer knows (it ended) is replaced: register again, claim again.

        A renewal that fails while the store answered nothing since it was sent makes a
        new connection (:meth:`reconnect`: the old one may answer keepalive pings and
        never a call) and is sent again on it at once, within the lease (was: every
        store call timed out for as long as that connection lasted, and the lease
        ended). At most one new connection per renewal period."""
        every = self.lease_seconds / 3
        again = False
        while True:
            if not again:
                await asyncio.sleep(every)
            retried, again = again, False
            sent = self.clock()
            try:
                async with asyncio.timeout(self.timeout):  # not wait_for: see _watch
                    reply = await self.client.refresh_lease(self.lease.id)
                self.answered_at = self.clock()
                if reply is not None and reply.TTL > 0:
                    self.view.valid_until = sent + reply.TTL
                    continue
                logger.error("replica %s lost its cluster lease: joining again", self.me.replica_id)
                self.view.lease_lost()  # (its claims with it: not served from them once registered)
                await self.register()
                await self.refresh()
                await self.claim_local()
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - retried; serving stops when the lease may end
                logger.warning("renewing the cluster lease failed: %s", exc)
                if not retried and self.answered_at < sent and not self.stopping:
                    again = await self.reconnect()

    async def _watch(self) -> None:
        """Follow members and claims: re-read the view once the watch is made (what
        changed while there was none), on every change, and every lease period (in
        case a watch missed one); a watch that fails is made again after a pause, as is
        one whose store call was cancelled under it (:func:`.tasks.uncancelled`: its
        client replaced and closed; this task used to end there, the view never
        followed the store again)."""
        while True:
            try:
                await uncancelled(self._watch_once())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - watched again after a pause
                logger.warning("watching the cluster store failed: %s", exc)
                await asyncio.sleep(min(1.0, self.lease_seconds / 3))

    async def _watch_once(self) -> None:
        reader = asyncio.get_running_loop().create_task(
            follow_changes(self.client, self.prefix, self._changed.set, self.timeout)
        )
        reader.add_done_callback(lambda _: self._changed.set())  # its end wakes the loop
        try:
            while True:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the
                # result when the change comes in the same turn as stop()'s
                # cancellation, the cancellation is lost, and stop() waits for this
                # loop forever
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.lease_seconds):
                        await self._changed.wait()
                self._changed.clear()
                if reader.done():
                    break
                await self.refresh()
                await self.claim_local()
                await self.recover_orphans()
                self._rebalance_beside()
        finally:
            await cancel_and_wait([reader])  # the stream ends at once (follow_changes)
        if reader.cancelled():
            raise ClusterError("the watch of the cluster store was cancelled")
        reader.result()  # why it ended (it never returns)


def _logged(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("a rebalance pass failed (tried again at the next change): %r", task.exception())
