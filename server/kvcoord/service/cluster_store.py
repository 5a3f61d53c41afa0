"""One replica's calls to the cluster store (etcd, ``[cluster]``): its membership,
its view and its claims; what the replica does with them is :mod:`.cluster`'s.

etcd already has exactly what a sharded allocator needs, so none of it is ours:

* **leases** are membership: a replica registers its member key
  (``/kvcoord/<cluster>/members/<replica id>``: its address) under a lease it keeps
  alive; a replica that stops renewing (dead, partitioned) leaves when the lease ends,
  and every key under the lease goes with it;
* **compare-and-swap transactions** are ownership: a pool's claim
  (``/kvcoord/<cluster>/owners/<pool>``: the holder's id and address) is created only
  if absent, under the claimant's lease, so at most one replica holds it, and is
  passed from one holder to the next in one transaction comparing its revision; the
  revision that last wrote it is the pool's *term* (it grows with every owner);
* **watches** tell every replica when members or claims change, so its view
  (:class:`~kvcoord.service.ownership.Ownership`) follows the store.

``/kvcoord/<cluster>/pools/<pool>`` (no lease) is the catalog of pools that exist in
the cluster: a pool listed there whose claim is gone (its owner died) is UNAVAILABLE,
never NOT_FOUND, and never silently created again empty elsewhere.
``/kvcoord/<cluster>/last/<pool>`` (no lease) names the replica that claimed the pool
last: a replica claims its own journal's copy again only if it is that one.

**Deleting a pool nobody serves** (its owner is gone): with the journal in the store
the replica placement names deletes it there (catalog and journal, only while nobody
claims it); with local journals it is refused OWNER_GONE, nothing deleted (its state
is on its owner's disk, and would come back with it).

Safety rests on one rule: a replica serves a pool only while it holds the claim and
its lease is sure to be alive (it counts the lease from the moment it *sent* the last
renewal that succeeded, so it stops before etcd can hand the claim to anyone else).
The rules themselves are in :mod:`.ownership`; this module only does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .cluster_client import (
    KEEPALIVE_SECONDS,
    KEEPALIVE_TIMEOUT_SECONDS,
    ClusterError,
    close_client,
    store_client,
)
from .cluster_endpoints import candidates
from .ownership import Claim, Member, Ownership, decode_claim, decode_member, encode_claim, encode_member
from .tasks import cancel_and_wait

if TYPE_CHECKING:  # pragma: no cover
    from .store_journal import PoolStreams

__all__ = [
    "KEEPALIVE_SECONDS",
    "KEEPALIVE_TIMEOUT_SECONDS",
    "ClusterError",
    "ClusterStore",
    "close_client",
    "prefix_range",
    "store_client",
]

logger = logging.getLogger(__name__)


class ClusterStore:
    """One replica's connection to the store: its lease, its view, its claims.

    Args:
        endpoints: etcd endpoints (host:port), tried in order.
        name: the cluster's key prefix.
        me: this replica.
        lease_seconds: the membership lease.
        timeout: the deadline of each store call.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        endpoints: Iterable[str],
        name: str,
        me: Member,
        lease_seconds: int,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoints = list(endpoints)
        self.prefix = f"/kvcoord/{name}/".encode()
        self.me = me
        self.lease_seconds = lease_seconds
        self.timeout = timeout
        self.clock = clock
        self.view = Ownership(me, clock, name)
        self.client: Any = None
        #: clients replaced by :meth:`reconnect`, each closed once its calls had their time
        self.retired: set[asyncio.Task[None]] = set()
        #: connections made so far (:meth:`reconnect` starts at the next endpoint)
        self.connects = 0
        #: the clock when the store last answered a renewal or a read of the view
        self.answered_at = -float("inf")
        self.lease: Any = None
        #: the store revision of this replica's registration: a read of the view begun
        #: before it lists the claims of a lease that ended (the store deleted them)
        self.registered_at = 0
        #: the store revision of the newest claims read applied to the view
        self.read_revision = 0
        self.tasks: list[asyncio.Task[None]] = []
        #: told of every claim this replica gains or loses (metrics)
        self.on_change: list[Callable[[], None]] = []
        #: told of each claim this replica gains: pool, term (the server records it)
        self.on_term: Callable[[str, int], None] | None = None
        self.stopping = False
        #: :meth:`stop` closed the client (every store call fails from then on)
        self.stopped = False
        #: the pools' journals in the store (journal = "store"; None: local only)
        self.streams: PoolStreams | None = None

    # -- keys ----------------------------------------------------------------------
    def key(self, kind: str, name: str = "") -> bytes:
        """The store key of ``name`` of ``kind`` (members, owners, pools)."""
        return self.prefix + kind.encode() + b"/" + name.encode()

    # -- connect and stop ----------------------------------------------------------------
    async def connect(self) -> None:
        """Connect to the first endpoint that answers.

        Raises:
            ClusterError: no endpoint answers.
        """
        self.client = await self._connected()

    async def _connected(self) -> Any:
        """A new client of the first endpoint that answers, from endpoint number
        :attr:`connects` on (a new channel: a new connection); an endpoint whose member
        names no leader (cut off from the quorum) only when none names one.

        Raises:
            ClusterError: no endpoint answers.
        """
        last: BaseException | None = None
        turn = self.connects
        self.connects += 1
        leaderless: Any = None
        try:
            for endpoint in candidates(self.endpoints, turn):
                client = store_client(endpoint, self.timeout)
                try:
                    await client.connect()
                    status = await client.status()
                except asyncio.CancelledError:
                    await close_client(client, self.timeout)
                    raise
                except Exception as exc:  # noqa: BLE001 - the next endpoint, then a ClusterError
                    last = exc
                    await close_client(client, self.timeout)
                    continue
                if status.leader is not None:
                    if leaderless is not None:
                        await close_client(leaderless, self.timeout)
                    return client
                # a member cut off from the quorum answers Status, and no renewal, read
                # or write: the next endpoint first (it was taken when its turn came)
                last = ClusterError(f"the cluster store member at {endpoint} has no leader")
                if leaderless is None:
                    leaderless, client = client, None
                else:
                    await close_client(client, self.timeout)
        except BaseException:
            if leaderless is not None:
                await close_client(leaderless, self.timeout)
            raise
        if leaderless is not None:  # none has a leader now (an election): as before
            return leaderless
        raise ClusterError(f"no cluster store endpoint answers ({', '.join(self.endpoints)}): {last!r}")

    async def reconnect(self) -> bool:
        """Replace the client by a new one (a new channel and connection), its
        endpoints tried from the next one on; the old client is closed once every
        unary call on it has passed its deadline (``timeout``), its watch with it (made
        again on the new one). For a connection that answers gRPC's keepalive pings
        but no call: one whose flow-control window was used up while the store's
        WINDOW_UPDATE frames were lost (no request can be sent on it, ever), a member
        cut off from the quorum, a proxy answering for a dead member. Keepalive sees
        such a connection alive, and the channel kept it for good (every store call
        timed out, the lease ended; tests/cluster/test_keepalive.py). True once
        replaced (False: no endpoint answers now; the old client is kept)."""
        try:
            client = await self._connected()
        except ClusterError as exc:
            logger.warning(
                "connecting to the cluster store again failed (the old connection is kept): %s", exc
            )
            return False
        old, self.client = self.client, client
        if old is not None:
            task = asyncio.get_running_loop().create_task(self._retire(old))
            self.retired.add(task)
            task.add_done_callback(self.retired.discard)
        logger.warning("the cluster store did not answer: connected to it again (a new connection)")
        return True

    async def _retire(self, client: Any) -> None:
        try:
            await asyncio.sleep(self.timeout)  # the calls on it end by their deadlines
        finally:  # at once when cancelled (stop)
            await close_client(client, self.timeout)

    async def register(self) -> None:
        """Put the member key under a new lease; wait out a previous process of the
        same replica id (its lease, and the claims under it, end by themselves)."""
        key = self.key("members", self.me.replica_id)
        deadline = self.clock() + self.lease_seconds + 2 * self.timeout
        while True:
            sent = self.clock()
            lease = await self.client.lease(self.lease_seconds)
            tx = self.client.transactions
            ok, responses = await self.client.transaction(
                compare=[tx.version(key) == 0],
                success=[tx.put(key, encode_member(self.me), lease=lease.id)],
                failure=[],
            )
            if ok:
                # a claim of this replica in the view now is of a lease that ended (the
                # new one holds none yet): one a read begun before brought back
                self.view.lease_lost()
                self.lease = lease
                self.registered_at = responses[0].response_put.header.revision
                self.view.valid_until = sent + lease.ttl
                logger.info(
                    "replica %s joined cluster %s as %s (lease %d s)",
                    self.me.replica_id, self.prefix.decode(), self.me.address, lease.ttl,
                )  # fmt: skip
                return
            await self.client.revoke_lease(lease.id)
            if self.clock() > deadline:
                raise ClusterError(
                    f"replica id {self.me.replica_id!r} is registered by another live process "
                    f"(its lease did not end within {self.lease_seconds} s): give each replica its own id"
                )
            logger.warning(
                "replica id %s is still registered (a previous process?): waiting for its lease to end",
                self.me.replica_id,
            )
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        """Leave the cluster: revoke the lease (the member key and every claim go). The
        closed client stays :attr:`client`: a store call made after this (a handler's
        that raced the stop) fails as a store call does (close_client), answered
        UNAVAILABLE (was: None, the handler's AttributeError answered INTERNAL)."""
        self.stopping = True
        await cancel_and_wait([*self.tasks, *self.retired])
        self.view.valid_until = 0.0
        if self.client is None or self.stopped:
            return
        self.stopped = True
        if self.lease is not None:
            try:
                await self.client.revoke_lease(self.lease.id)
            except Exception as exc:  # noqa: BLE001 - the lease then ends by itself
                logger.warning("revoking the cluster lease failed (it ends by itself): %s", exc)
        await close_client(self.client, self.timeout)

    # -- the view -----------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read members, claims and the catalog from the store into the view."""
        # A pool's claim and catalog entry are created (CreatePool) and removed
        # (DeletePool) together, but these are separate reads: the catalog is read
        # before the claims and again after, and only what both reads list counts. A
        # pool created or deleted meanwhile is then never one of the catalog without a
        # claim, which recover_orphans would take for a pool whose owner died and
        # rebuild (its own replica replacing its fresh pool, or claiming a deleted one
        # again; callers meanwhile bounced between replicas).
        members = await self.client.get_prefix(self.key("members"))
        listed = await self.client.get_prefix(self.key("pools"), keys_only=True)
        claims = await self.client.get_prefix(self.key("owners"))
        listed_after = await self.client.get_prefix(self.key("pools"), keys_only=True)
        if members.header.revision < self.registered_at or claims.header.revision < self.read_revision:
            # begun before this replica registered again, or older claims than a read
            # applied already (reads run from several tasks: the watch, the keep-alive,
            # DeletePool): applying it would bring back an ended lease's claims, or older
            # claims, and serve a pool another replica holds
            return
        self.read_revision = claims.header.revision
        before = set(self.view.owned())
        view = self.view
        view.set_members(_decoded(members, lambda kv: decode_member(kv.value)))
        owners_prefix = len(self.key("owners"))
        view.set_claims(
            _decoded(
                claims, lambda kv: decode_claim(kv.key[owners_prefix:].decode(), kv.value, kv.mod_revision)
            ),
            claims.header.revision,
        )
        pools_prefix = len(self.key("pools"))
        catalog = {kv.key[pools_prefix:].decode() for kv in listed}
        view.set_catalog(catalog.intersection(kv.key[pools_prefix:].decode() for kv in listed_after))
        self.answered_at = self.clock()
        if set(view.owned()) != before:
            for fn in self.on_change:
                fn()

    async def claim(self, pool: str, own_copy: bool = False) -> Claim | None:
        """Create ``pool``'s claim under this replica's lease if nobody holds it, and
        list the pool in the catalog. Returns the claim (None: another replica holds it).

        ``own_copy``: for the copy this replica holds (its local journal's), made only
        if no other replica claimed the pool last (its ``last`` key): a copy handed over
        before this replica was killed (not removed yet) lacks what the new owner
        acknowledged since, so the pool waits for that one (None, logged), whose claim
        then sends the copy here away (:meth:`Cluster.claim_local`)."""
        key, last = self.key("owners", pool), self.key("last", pool)
        tx = self.client.transactions
        me = self.me.replica_id.encode()
        success = [
            tx.put(key, encode_claim(self.me.replica_id, self.me.address), lease=self.lease.id),
            tx.put(self.key("pools", pool), b""),
            tx.put(last, me),
        ]
        compare = [tx.version(key) == 0]
        ok, responses = await self.client.transaction(
            compare=[*compare, tx.version(last) == 0] if own_copy else compare,
            success=success,
            failure=[tx.get(key), tx.get(last)],
        )
        if not ok and own_copy and not responses[0] and responses[1]:
            holder = responses[1][0][0]
            if holder != me:  # (this replica stopped before it removed its copy of a handover)
                who = holder.decode(errors="replace")[:200]
                logger.error("pool %s: the copy here is not claimed: replica %s claimed the pool after this one "
                             "(the copy lacks what it acknowledged since): the pool waits for it", pool, who)  # fmt: skip
                return None
            ok, responses = await self.client.transaction(  # this replica held it last: its copy
                compare=[*compare, tx.value(last) == me], success=success, failure=[tx.get(key)]
            )
        if ok:
            claim = Claim(
                pool, self.me.replica_id, self.me.address, responses[0].response_put.header.revision
            )
            logger.info("claimed pool %s (term %d)", pool, claim.term)
        else:
            rows = responses[0]
            if not rows:  # released between the compare and the read: the next call retries
                return None
            value, kv = rows[0]
            claim = decode_claim(pool, value, kv.mod_revision)
        self.view.learned(pool, claim, claim.term)
        for fn in self.on_change:
            fn()
        if claim.replica_id != self.me.replica_id:
            return None
        if self.on_term is not None:
            self.on_term(pool, claim.term)
        return claim

    async def forget(self, pool: str) -> bool:
        """The pool was deleted: drop it from the catalog (and its journal from the store)
        and release its claim if it is this replica's (the view's: compared on its term).
        False (nothing changed) when it is not and the journal is in the store (another
        owner's now). A delete whose answer was lost, carried out by etcd late, never
        deletes a later claim of the pool made here (was compared on the value, alike)."""
        tx, key, held = self.client.transactions, self.key("owners", pool), self.view.claims.get(pool)
        success = [tx.delete(key), tx.delete(self.key("pools", pool)), tx.delete(self.key("last", pool))]
        if self.streams is not None:
            success.append(tx.delete(*prefix_range(self.streams.pool_prefix(pool))))
        if held is not None and held.replica_id == self.me.replica_id:
            compare = tx.mod(key) == held.term
        else:
            compare = tx.value(key) == encode_claim(self.me.replica_id, self.me.address)
        ok, responses = await self.client.transaction(compare=[compare], success=success, failure=[])
        if not ok and self.streams is not None:
            return False  # the pool's journal in the store is another owner's now
        if responses:
            self.view.learned(pool, None, responses[0].response_delete_range.header.revision)
        self.view.catalog.discard(pool)
        for fn in self.on_change:
            fn()
        return True

    async def delete_unclaimed(self, pool: str) -> bool:
        """Delete ``pool`` from the cluster (its catalog entry and its journal in the
        store) only while nobody claims it: True once done; False when a replica
        claimed it or a delete removed it meanwhile (the view is read again: the usual
        rules then answer). Compared on the catalog entry's revision read first (every
        claim writes it again; a pool made again is a new entry): a delete carried out
        late never lands on a pool claimed and served since, or made again, whose owner
        then died (was: "nobody claims it" and "it is in the catalog" held again, and its
        journal, acknowledged allocations, went)."""
        assert self.streams is not None
        tx = self.client.transactions
        key, entry = self.key("owners", pool), self.key("pools", pool)
        found = await self.client.get(entry)
        ok = False
        if found is not None:
            ok, _ = await self.client.transaction(
                compare=[tx.version(key) == 0, tx.mod(entry) == found.mod_revision],
                success=[
                    tx.delete(entry),
                    tx.delete(self.key("last", pool)),
                    tx.delete(*prefix_range(self.streams.pool_prefix(pool))),
                ],
                failure=[],
            )
        if ok:
            self.view.catalog.discard(pool)
            logger.warning("deleted pool %s, which no replica served, from the cluster store", pool)
            for fn in self.on_change:
                fn()
            return True
        await self.refresh()
        return False

    async def release(self, pool: str) -> None:
        """Give up this replica's claim of ``pool`` (its journal in the store could not
        be written, or it holds no state of it): whoever placement names claims it and
        rebuilds it from the store."""
        claim = self.view.claims.get(pool)
        if claim is None or claim.replica_id != self.me.replica_id or self.client is None or self.stopped:
            return
        tx = self.client.transactions
        key = self.key("owners", pool)
        ok, responses = await self.client.transaction(
            compare=[tx.mod(key) == claim.term], success=[tx.delete(key)], failure=[]
        )
        if ok:
            self.view.learned(pool, None, responses[0].response_delete_range.header.revision)
            logger.warning("released the claim of pool %s (term %d)", pool, claim.term)
            for fn in self.on_change:
                fn()

    async def reclaim(self, pool: str, revision: int) -> Claim | None:
        """Put this replica's claim of ``pool`` again, if it is still the one at
        ``revision``: the claim gets a new revision, so a swap compared on ``revision``
        (an adopter's :meth:`take_over` still on its way, or applied by the store
        after its caller gave up) can never land. Returns the new claim, or None when
        the claim is no longer that one (the view is read again)."""
        claim = await self.take_over(pool, self.me.replica_id, revision)  # (the same swap, to itself)
        if claim is None:
            await self.refresh()
        else:
            logger.info("claimed pool %s again (term %d after %d)", pool, claim.term, revision)
        return claim

    async def take_over(self, pool: str, from_replica: str, claim_revision: int) -> Claim | None:
        """Swap ``pool``'s claim from ``from_replica`` (at ``claim_revision``) to this
        replica, under its lease; None when the claim is no longer that one."""
        key = self.key("owners", pool)
        tx = self.client.transactions
        ok, responses = await self.client.transaction(
            compare=[tx.mod(key) == claim_revision],
            success=[
                tx.put(key, encode_claim(self.me.replica_id, self.me.address), lease=self.lease.id),
                tx.put(self.key("last", pool), self.me.replica_id.encode()),
            ],
            failure=[],
        )
        if not ok:
            return None
        claim = Claim(pool, self.me.replica_id, self.me.address, responses[0].response_put.header.revision)
        self.view.learned(pool, claim, claim.term)
        for fn in self.on_change:
            fn()
        if self.on_term is not None:
            self.on_term(pool, claim.term)
        return claim


def prefix_range(prefix: bytes) -> tuple[bytes, bytes]:
    """The key range of every key that starts with ``prefix`` (it ends in "/")."""
    return prefix, prefix[:-1] + bytes([prefix[-1] + 1])


def _decoded(rows: Any, decode: Callable[[Any], Any]) -> list[Any]:
    out = []
    for kv in rows:
        try:
            out.append(decode(kv))
        except ValueError as exc:
            logger.error("ignoring a malformed cluster record %r: %s", kv.key[:200], exc)
    return out
