"""A replica's membership and pool ownership, held in etcd (``[cluster]``).

etcd already has exactly what a sharded allocator needs, so none of it is ours:

* **leases** are membership: a replica registers its member key
  (``/kvcoord/<cluster>/members/<replica id>``: its address) under a lease it keeps
  alive; a replica that stops renewing (dead, partitioned) leaves when the lease ends,
  and every key under the lease goes with it;
* **compare-and-swap transactions** are ownership: a pool's claim
  (``/kvcoord/<cluster>/owners/<pool>``: the holder's id and address) is created only
  if absent, under the claimant's lease, so at most one replica holds it; the
  revision that created it is the pool's *term*;
* **watches** tell every replica when members or claims change, so its view
  (:class:`~kvcoord.service.ownership.Ownership`) follows the store.

``/kvcoord/<cluster>/pools/<pool>`` (no lease) is the catalog of pools that exist in
the cluster: a pool listed there whose claim is gone (its owner died) is UNAVAILABLE,
never NOT_FOUND, and never silently created again empty elsewhere.

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
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from .errors import ServiceError
from .ownership import Claim, Member, Ownership, decode_claim, decode_member, encode_claim, encode_member
from .registry import Placement

__all__ = ["Cluster", "ClusterError", "ClusterPlacement"]

logger = logging.getLogger(__name__)


class ClusterError(Exception):
    """The cluster store cannot be reached or refuses this replica (at start)."""


def _client(endpoint: str, timeout: float) -> Any:
    import aetcd  # type: ignore[import-untyped]  # the "cluster" extra: only a clustered replica needs it

    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host, port=int(port), timeout=timeout)


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
        for endpoint in self.endpoints:
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
        await self.refresh()
        await self.claim_local()
        self._tasks = [
            asyncio.get_running_loop().create_task(self._keep_alive()),
            asyncio.get_running_loop().create_task(self._watch()),
        ]

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
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
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
        members = await self.client.get_prefix(self._key("members"))
        claims = await self.client.get_prefix(self._key("owners"))
        catalog = await self.client.get_prefix(self._key("pools"), keys_only=True)
        before = set(self.view.owned())
        view = self.view
        view.set_members(_decoded(members, lambda kv: decode_member(kv.value)))
        owners_prefix = len(self._key("owners"))
        view.set_claims(
            _decoded(
                claims, lambda kv: decode_claim(kv.key[owners_prefix:].decode(), kv.value, kv.create_revision)
            )
        )
        pools_prefix = len(self._key("pools"))
        view.set_catalog(kv.key[pools_prefix:].decode() for kv in catalog)
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
            claim = decode_claim(pool, value, kv.create_revision)
        self.view.claims[pool] = claim
        for fn in self.on_change:
            fn()
        return claim if claim.replica_id == self.me.replica_id else None

    async def claim_local(self) -> None:
        """Claim every pool this replica holds state of that nobody claims."""
        for pool in self.view.should_claim(self.local_pools()):
            claim = await self.claim(pool)
            if claim is None:
                holder = self.view.claims.get(pool)
                logger.error(
                    "pool %s is held here but claimed by replica %s: it is not served here",
                    pool, holder.replica_id if holder else "?",
                )  # fmt: skip

    async def forget(self, pool: str) -> None:
        """The pool was deleted: drop it from the catalog and release its claim."""
        tx = self.client.transactions
        key = self._key("owners", pool)
        await self.client.transaction(
            compare=[tx.value(key) == encode_claim(self.me.replica_id, self.me.address)],
            success=[tx.delete(key), tx.delete(self._key("pools", pool))],
            failure=[],
        )
        self.view.claims.pop(pool, None)
        self.view.catalog.discard(pool)
        for fn in self.on_change:
            fn()

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
                reply = await asyncio.wait_for(self.client.refresh_lease(self.lease.id), self.timeout)
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
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), self.lease_seconds)
                        self._changed.clear()
                        await self.refresh()
                        await self.claim_local()
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


def _decoded(rows: Any, decode: Callable[[Any], Any]) -> list[Any]:
    out = []
    for kv in rows:
        try:
            out.append(decode(kv))
        except ValueError as exc:
            logger.error("ignoring a malformed cluster record %r: %s", kv.key[:200], exc)
    return out


class ClusterPlacement(Placement):
    """A clustered replica's :class:`~kvcoord.service.registry.Placement`: the
    rules of :class:`Ownership`, with claims made through :class:`Cluster`."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.replica_id = cluster.me.replica_id

    def check(self, pool: str, local: bool) -> None:
        self.cluster.view.check(pool, local)

    def serves(self, pool: str) -> bool:
        return self.cluster.view.holds(pool)

    async def before_create(self, pool: str) -> None:
        view = self.cluster.view
        if view.holds(pool):
            return
        view.check(pool, local=False)
        if await self.cluster.claim(pool) is None:
            view.check(pool, local=False)  # the holder's redirect
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"pool {pool[:200]!r} could not be claimed: retry"
            )

    async def after_delete(self, pool: str) -> None:
        await self.cluster.forget(pool)
