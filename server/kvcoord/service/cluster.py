"""A replica's membership and pool ownership, held in etcd (``[cluster]``).

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

**Handover.** When a member joins, each replica hands the pools placement now puts on
the joiner over to it; a replica leaving gracefully (SIGTERM) hands each of its pools
to placement over the others. The old owner stops serving the pool (calls are
UNAVAILABLE: clients retry), sends its state (registry_state.dump_pool: engine, events,
sessions with cursors, kept answers, lineage) with ``Replicas.AdoptPool``; the new
owner journals it (an ``adopt`` record) and waits until it is durable, then swaps the
claim to itself (compare-and-swap on the claim's revision) and serves; only then does
the old owner remove its copy (journaled). A failure at any step before the swap
leaves the old owner serving; after it, the new owner's journal has the state.
The call is made as the replicas serve (``[server.tls]``: TLS, and a client certificate
under mutual TLS; ``[cluster.peer_tls]``, tls.py) with the first full-access token.

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
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from .ownership import Claim, Member, Ownership, decode_claim, decode_member, encode_claim, encode_member
from .tasks import cancel_and_wait

if TYPE_CHECKING:  # pragma: no cover
    from .store_journal import PoolStreams

__all__ = ["Cluster", "ClusterError"]

logger = logging.getLogger(__name__)


class ClusterError(Exception):
    """The cluster store cannot be reached or refuses this replica (at start)."""


def _client(endpoint: str, timeout: float) -> Any:
    try:
        import aetcd  # type: ignore[import-untyped]  # the "cluster" extra: only a clustered replica needs it
    except ImportError:
        raise ClusterError(
            "[cluster] needs etcd's client: pip install 'kvcoord[cluster]' (the aetcd package)"
        ) from None

    host, _, port = endpoint.rpartition(":")
    # a pool's journal in the store is read whole when it is rebuilt: a large pool's
    # base alone passes gRPC's default 4 MiB limit of an answer
    options = {"grpc.max_receive_message_length": -1}
    return aetcd.Client(host=host, port=int(port), timeout=timeout, options=options)


def _targets(endpoints: list[str]) -> list[str]:
    """What to connect to, in order. Endpoints that are all IPv4 addresses become one
    gRPC target listing them all, so the channel moves to another store member by
    itself when the one it uses dies (pick-first over the list); names are tried one
    by one at start (a Kubernetes service name already leads to a live member)."""
    hosts = [e.rpartition(":")[0] for e in endpoints]
    if len(endpoints) > 1 and all(_is_ipv4(h) for h in hosts):
        return ["ipv4:" + ",".join(endpoints)]
    return endpoints


def _is_ipv4(host: str) -> bool:
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts)


class Cluster:
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
        self.view = Ownership(me, clock)
        self.client: Any = None
        self.lease: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        #: the pools this replica holds state of (the registry's); set by the server
        self.local_pools: Callable[[], Iterable[str]] = list
        #: told of every claim this replica gains or loses (metrics)
        self.on_change: list[Callable[[], None]] = []
        #: a pool's state for a handover (registry_state.dump_pool, CBOR; a large pool's
        #: encoded off the loop, state_export.py); set by the server
        self.export_pool: Callable[[str], Awaitable[bytes]] | None = None
        #: returns once no Step is applied to the pool in slices (pool_locks.py)
        self.pool_free: Callable[[str], Awaitable[None]] | None = None
        #: the end of a handover: the pool is removed here (journaled); set by the server
        self.handed_over: Callable[[str], None] | None = None
        #: pools being adopted: held here, not claimed yet (claim_local leaves them be)
        self.adopting: set[str] = set()
        #: metadata of calls to other replicas (a full-access token, if the server has one)
        self.peer_metadata: tuple[tuple[str, str], ...] = ()
        #: TLS of calls to other replicas (tls.peer_credentials; None: plaintext)
        self.peer_tls: tuple[grpc.ChannelCredentials, list[tuple[str, str]]] | None = None
        #: told of each claim this replica gains: pool, term (the server records it)
        self.on_term: Callable[[str, int], None] | None = None
        #: handovers done and failed (metrics, tests)
        self.handovers = 0
        self.handover_failures = 0
        self.stopping = False
        #: the pools' journals in the store (journal = "store"; None: local only)
        self.streams: PoolStreams | None = None
        #: remove the local copy of a pool (recorded locally, no redirect); set by the server
        self.drop_local: Callable[[str], None] | None = None
        #: load a pool rebuilt from the store under a new term, and wait until durable
        self.load_pool: Callable[[dict[str, Any], int], Awaitable[None]] | None = None
        #: a fresh scratch registry whose instance is the given writer (rebuilding)
        self.scratch_registry: Callable[[str], Any] | None = None
        #: pools rebuilt from the store after their owner was gone (metrics, tests)
        self.failovers = 0
        #: pools whose rebuilding failed -> when to try again
        self._retry_at: dict[str, float] = {}

    # -- keys ----------------------------------------------------------------------
    def _key(self, kind: str, name: str = "") -> bytes:
        return self.prefix + kind.encode() + b"/" + name.encode()

    # -- start and stop ----------------------------------------------------------------
    async def start(self) -> None:
        """Connect, register this replica under a fresh lease, read the view, claim
        the pools this replica holds state of, and keep all of it up to date.

        Raises:
            ClusterError: no endpoint answers, or another live process registered
                this replica id and its lease did not end within lease_seconds.
        """
        last: BaseException | None = None
        for endpoint in _targets(self.endpoints):
            client = _client(endpoint, self.timeout)
            try:
                await client.connect()
                await client.status()
            except Exception as exc:  # noqa: BLE001 - the next endpoint, then a ClusterError
                last = exc
                with contextlib.suppress(Exception):
                    await client.close()
                continue
            self.client = client
            break
        if self.client is None:
            raise ClusterError(f"no cluster store endpoint answers ({', '.join(self.endpoints)}): {last!r}")
        await self._register()
        # renewed from now on: rebuilding this replica's pools from the store (a large
        # pool's journal) may take longer than the lease
        self._tasks = [asyncio.get_running_loop().create_task(self._keep_alive())]
        await self.refresh()
        await self.claim_local()
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch()))

    async def _register(self) -> None:
        """Put the member key under a new lease; wait out a previous process of the
        same replica id (its lease, and the claims under it, end by themselves)."""
        key = self._key("members", self.me.replica_id)
        deadline = self.clock() + self.lease_seconds + 2 * self.timeout
        while True:
            sent = self.clock()
            lease = await self.client.lease(self.lease_seconds)
            tx = self.client.transactions
            ok, _ = await self.client.transaction(
                compare=[tx.version(key) == 0],
                success=[tx.put(key, encode_member(self.me), lease=lease.id)],
                failure=[],
            )
            if ok:
                self.lease = lease
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
        """Leave the cluster: revoke the lease (the member key and every claim go)."""
        self.stopping = True
        await cancel_and_wait(self._tasks)
        self.view.valid_until = 0.0
        if self.client is None:
            return
        if self.lease is not None:
            try:
                await self.client.revoke_lease(self.lease.id)
            except Exception as exc:  # noqa: BLE001 - the lease then ends by itself
                logger.warning("revoking the cluster lease failed (it ends by itself): %s", exc)
        with contextlib.suppress(Exception):
            await self.client.close()
        self.client = None

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
        members = await self.client.get_prefix(self._key("members"))
        listed = await self.client.get_prefix(self._key("pools"), keys_only=True)
        claims = await self.client.get_prefix(self._key("owners"))
        listed_after = await self.client.get_prefix(self._key("pools"), keys_only=True)
        before = set(self.view.owned())
        view = self.view
        view.set_members(_decoded(members, lambda kv: decode_member(kv.value)))
        owners_prefix = len(self._key("owners"))
        view.set_claims(
            _decoded(
                claims, lambda kv: decode_claim(kv.key[owners_prefix:].decode(), kv.value, kv.mod_revision)
            ),
            claims.header.revision,
        )
        pools_prefix = len(self._key("pools"))
        catalog = {kv.key[pools_prefix:].decode() for kv in listed}
        view.set_catalog(catalog.intersection(kv.key[pools_prefix:].decode() for kv in listed_after))
        if set(view.owned()) != before:
            for fn in self.on_change:
                fn()

    async def claim(self, pool: str) -> Claim | None:
        """Create ``pool``'s claim under this replica's lease if nobody holds it, and
        list the pool in the catalog. Returns the claim (None: another replica holds it)."""
        key = self._key("owners", pool)
        tx = self.client.transactions
        ok, responses = await self.client.transaction(
            compare=[tx.version(key) == 0],
            success=[
                tx.put(key, encode_claim(self.me.replica_id, self.me.address), lease=self.lease.id),
                tx.put(self._key("pools", pool), b""),
            ],
            failure=[tx.get(key)],
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

    async def claim_local(self) -> None:
        """Claim every pool this replica holds state of that nobody claims. A copy
        held here whose claim another replica holds was handed over (this replica
        stopped before removing it): it is removed. With the journal in the store, the
        store is the pool's history: a pool claimed again is rebuilt from it (the copy
        here may be behind what a later owner acknowledged)."""
        local = [p for p in self.local_pools() if p not in self.adopting]
        for pool in self.view.should_claim(local):
            try:
                if self.streams is not None:
                    await self.recover(pool)
                else:
                    await self.claim(pool)
            except Exception as exc:  # noqa: BLE001 - a slow store: claimed at the next pass
                # (the watch passes again at every change and every lease; was: raised
                # on, and at start the replica exited 1 while the store was slow)
                logger.error("pool %s could not be claimed (tried again within a lease): %r", pool, exc)
        for pool in local:
            holder = self.view.claims.get(pool)
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

    async def forget(self, pool: str) -> bool:
        """The pool was deleted: drop it from the catalog (and its journal from the
        store) and release its claim, if the claim is this replica's. False (nothing
        changed) when it is not and the journal is in the store (it is another
        owner's now)."""
        tx = self.client.transactions
        key = self._key("owners", pool)
        success = [tx.delete(key), tx.delete(self._key("pools", pool))]
        if self.streams is not None:
            success.append(tx.delete(*_prefix_range(self.streams.pool_prefix(pool))))
        ok, responses = await self.client.transaction(
            compare=[tx.value(key) == encode_claim(self.me.replica_id, self.me.address)],
            success=success,
            failure=[],
        )
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
        rules then answer)."""
        assert self.streams is not None
        tx = self.client.transactions
        key = self._key("owners", pool)
        ok, _ = await self.client.transaction(
            compare=[tx.version(key) == 0, tx.version(self._key("pools", pool)) > 0],
            success=[
                tx.delete(self._key("pools", pool)),
                tx.delete(*_prefix_range(self.streams.pool_prefix(pool))),
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
        if claim is None or claim.replica_id != self.me.replica_id or self.client is None:
            return
        tx = self.client.transactions
        key = self._key("owners", pool)
        ok, responses = await self.client.transaction(
            compare=[tx.mod(key) == claim.term], success=[tx.delete(key)], failure=[]
        )
        if ok:
            self.view.learned(pool, None, responses[0].response_delete_range.header.revision)
            logger.warning("released the claim of pool %s (term %d)", pool, claim.term)
            for fn in self.on_change:
                fn()

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
                await self.release(pool)
        now = self.clock()
        for pool in view.orphans():
            if self.stopping or not view.lease_valid:
                return
            if pool not in self.adopting and self._retry_at.get(pool, 0.0) <= now:
                await self.recover(pool)

    async def recover(self, pool: str) -> bool:
        """Claim ``pool`` (a new term: its former owner can write nothing more), rebuild
        it from its journal in the store and serve it. True once served here."""
        assert self.streams is not None and self.load_pool is not None and self.scratch_registry is not None
        from .store_journal import rebuild, stream_rows

        view = self.view
        if pool in view.claims or pool in view.moving or pool in self.adopting:
            return view.holds(pool)  # claimed (or being moved) since it was found unclaimed
        view.moving.add(pool)
        self.adopting.add(pool)
        try:
            if pool in self.local_pools() and self.drop_local is not None:
                self.drop_local(pool)  # the store has its history
            claim = await self.claim(pool)
            if claim is None:
                return False
            prefix = self.streams.pool_prefix(pool)
            try:
                rows = await self.client.get_prefix(prefix)
            except Exception as exc:  # noqa: BLE001 - a slow or cut-off store: tried again later
                # (was: raised on; at start that ended the process, exit 1, and a
                # store slow for a moment put the replica in a crash loop)
                logger.error(
                    "pool %s: its journal could not be read from the cluster store (tried again in %d s): %r",
                    pool, self.lease_seconds, exc,
                )  # fmt: skip
                self._retry_at[pool] = self.clock() + self.lease_seconds
                try:
                    await self.release(pool)
                except Exception as again:  # noqa: BLE001 - recover_orphans releases it later
                    logger.warning("pool %s: its claim could not be released: %r", pool, again)
                return False
            try:
                rebuilt = rebuild(stream_rows(rows, prefix), self.scratch_registry, pool)
            except Exception as exc:  # noqa: BLE001 - loud, and the pool stays unserved here
                logger.critical(
                    "pool %s cannot be rebuilt from its journal in the cluster store (tried again in "
                    "%d s): %r", pool, self.lease_seconds, exc,
                )  # fmt: skip
                self._retry_at[pool] = self.clock() + self.lease_seconds
                await self.release(pool)
                return False
            if rebuilt is None:  # created, never acknowledged anything: it does not exist
                logger.warning("pool %s has no journal in the cluster store: removed from the catalog", pool)
                await self.forget(pool)
                return False
            value, old_term, records = rebuilt
            await self.load_pool(value, claim.term)
            self.failovers += 1
            logger.warning(
                "took pool %s over from the cluster store (term %d after %d; %d records replayed)",
                pool, claim.term, old_term, records,
            )  # fmt: skip
            return True
        finally:
            self.adopting.discard(pool)
            view.moving.discard(pool)

    # -- handovers ----------------------------------------------------------------------
    async def rebalance(self) -> None:
        """Hand over every pool placement now puts on another member (one joined)."""
        for pool, target in self.view.hand_overs().items():
            if self.stopping:
                return
            await self.hand_over(pool, target)

    async def leave(self) -> None:
        """A graceful stop: hand every pool over to placement over the other members
        (one without a live member to go to stays unclaimed until this one is back)."""
        self.stopping = True
        try:  # no other replica places a pool here from now on
            await self.client.delete(self._key("members", self.me.replica_id))
        except Exception as exc:  # noqa: BLE001 - its lease still ends it
            logger.warning("leaving: the member key could not be deleted: %s", exc)
        for pool, target in self.view.leaving().items():
            await self.hand_over(pool, target)

    async def hand_over(self, pool: str, target: Member) -> bool:
        """Move ``pool`` to ``target`` (see the module docstring); True once it has it."""
        claim = self.view.claims.get(pool)
        if claim is None or claim.replica_id != self.me.replica_id or self.export_pool is None:
            return False
        view = self.view
        view.moving.add(pool)
        try:
            if self.pool_free is not None:  # a Step applied to it in slices ends first
                await self.pool_free(pool)
            request = pb.AdoptPoolRequest(
                pool=pool,
                state=await self.export_pool(pool),
                from_replica=self.me.replica_id,
                claim_revision=claim.term,
            )
            async with self._peer_channel(target.address) as channel:
                answer = await pb_grpc.ReplicasStub(channel).AdoptPool(  # type: ignore[no-untyped-call]
                    request, timeout=max(30.0, self.timeout), metadata=self.peer_metadata
                )
        except Exception as exc:  # noqa: BLE001 - the pool stays here, served again
            self.handover_failures += 1
            await self._settle_failed_handover(pool, exc)
            return False
        view.learned(pool, Claim(pool, target.replica_id, target.address, answer.term), answer.term)
        if self.handed_over is not None:
            self.handed_over(pool)
        view.moving.discard(pool)
        self.handovers += 1
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

    def _peer_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to another replica: TLS when the replicas serve TLS ([server.tls])."""
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        if self.peer_tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        credentials, extra = self.peer_tls
        return grpc.aio.secure_channel(address, credentials, options=[*options, *extra])

    async def _settle_failed_handover(self, pool: str, exc: BaseException) -> None:
        """After a handover that failed: serve the pool again if the claim is still
        this replica's; if the new owner swapped it (and then failed to answer), the
        copy here is removed, since the new owner's journal has the state."""
        view = self.view
        try:
            await self.refresh()
        except Exception as again:  # noqa: BLE001 - the claim is unknown: keep not serving
            logger.error(
                "handing pool %s over failed (%s), and the store cannot be read: %s", pool, exc, again
            )
            return
        holder = view.claims.get(pool)
        if holder is not None and holder.replica_id != self.me.replica_id:
            logger.warning(
                "pool %s: the handover's answer was lost, but replica %s holds it", pool, holder.replica_id
            )
            if self.handed_over is not None:
                self.handed_over(pool)
        else:
            logger.error("handing pool %s over failed; it is served here again: %s", pool, exc)
        view.moving.discard(pool)

    async def take_over(self, pool: str, from_replica: str, claim_revision: int) -> Claim | None:
        """Swap ``pool``'s claim from ``from_replica`` (at ``claim_revision``) to this
        replica, under its lease; None when the claim is no longer that one."""
        key = self._key("owners", pool)
        tx = self.client.transactions
        ok, responses = await self.client.transaction(
            compare=[tx.mod(key) == claim_revision],
            success=[tx.put(key, encode_claim(self.me.replica_id, self.me.address), lease=self.lease.id)],
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

    # -- background ---------------------------------------------------------------------
    async def _keep_alive(self) -> None:
        """Renew the lease every third of its time. A renewal that fails leaves the
        view's validity where the last success put it: past it, nothing is served. A
        lease etcd no longer knows (it ended) is replaced: register again, claim again."""
        every = self.lease_seconds / 3
        while True:
            await asyncio.sleep(every)
            sent = self.clock()
            try:
                async with asyncio.timeout(self.timeout):  # not wait_for: see _watch
                    reply = await self.client.refresh_lease(self.lease.id)
                if reply is not None and reply.TTL > 0:
                    self.view.valid_until = sent + reply.TTL
                    continue
                logger.error("replica %s lost its cluster lease: joining again", self.me.replica_id)
                self.view.valid_until = 0.0
                await self._register()
                await self.refresh()
                await self.claim_local()
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - retried; serving stops when the lease may end
                logger.warning("renewing the cluster lease failed: %s", exc)

    async def _watch(self) -> None:
        """Follow members and claims: re-read the view on every change (and every
        lease period, in case a watch missed one)."""
        while True:
            try:
                watch = await self.client.watch_prefix(self.prefix)
                reader = asyncio.get_running_loop().create_task(self._changes(watch))
                try:
                    while not reader.done():
                        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns
                        # the result when the change comes in the same turn as stop()'s
                        # cancellation, the cancellation is lost, and stop() waits for
                        # this loop forever
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.lease_seconds):
                                await self._changed.wait()
                        self._changed.clear()
                        await self.refresh()
                        await self.claim_local()
                        await self.recover_orphans()
                        await self.rebalance()
                finally:
                    reader.cancel()
                    with contextlib.suppress(Exception):
                        await watch.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - watched again after a pause
                logger.warning("watching the cluster store failed: %s", exc)
                await asyncio.sleep(min(1.0, self.lease_seconds / 3))

    async def _changes(self, watch: Any) -> None:
        async for _ in watch:
            self._changed.set()


def _prefix_range(prefix: bytes) -> tuple[bytes, bytes]:
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
