"""A pool taken over from the cluster store (``[cluster] journal = "store"``) by the
replica placement names once its owner is gone: claimed under a new term, rebuilt from
its journal there on a thread of its own (store_rebuild.py: the replica's keep-alive,
watch and other pools' calls go on meanwhile), made ready to load (decoded, its engine
built) on another (pool_load.py), and loaded only while that claim is still this
replica's: :meth:`ClusterRecovery.recover`, a base of :class:`.cluster.Cluster`. The pool
is "moving" throughout: its calls here are told OWNER_CHANGING (retry here).

**The claim after the rebuild.** A rebuild may outlast what it was made for: the
replica's lease may have ended meanwhile (its keep-alive failed: the claim went with
it), or the claim may have been given up or deleted in the store. The claim is read
from the store again before the pool is loaded: unless it is still this replica's, at
the term the rebuild is for, under a lease the replica holds, nothing is loaded
(logged as an error; the pool is taken over again at a later pass). Loaded anyway, the
pool would be served under a term that is gone, from a history another owner may be
writing past."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from .cluster_store import ClusterStore
from .ownership import Claim, decode_claim

__all__ = ["ClusterRecovery"]

logger = logging.getLogger(__name__)


class ClusterRecovery(ClusterStore):
    """:meth:`recover`, for :class:`~.cluster.Cluster` (its base: the attributes below
    are set by its constructor)."""

    #: pools being claimed and rebuilt here (not served until loaded)
    adopting: set[str]
    #: the pools this replica holds state of
    local_pools: Callable[[], Iterable[str]]
    #: removes a pool's copy here (the store has its history)
    drop_local: Callable[[str], None] | None
    #: a rebuilt pool's state (as a value, or as CBOR) made ready to load, off the loop
    #: (pool_load.loaded_apart)
    prepare_pool: Callable[[dict[str, Any] | None, bytes | None], Awaitable[Any]] | None
    #: loads a rebuilt pool made ready to load under a term
    load_pool: Callable[[Any, int], Awaitable[None]] | None
    #: a fresh scratch registry whose instance is the given writer (rebuilding)
    scratch_registry: Callable[[str], Any] | None
    #: pools taken over from the store here
    failovers: int
    #: pools whose rebuilding failed -> when to try again
    _retry_at: dict[str, float]

    async def recover(self, pool: str) -> bool:
        """Claim ``pool`` (a new term: its former owner can write nothing more), rebuild
        it from its journal in the store and serve it. True once served here."""
        assert self.streams is not None and self.load_pool is not None and self.scratch_registry is not None
        from .store_rebuild import rebuilt_apart

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
                await self._given_back(pool, ": its journal could not be read from the cluster store", exc)
                return False
            try:
                rebuilt = await rebuilt_apart(rows, prefix, self.scratch_registry, pool)
            except Exception as exc:  # noqa: BLE001 - loud, and the pool stays unserved here
                why = " cannot be rebuilt from its journal in the cluster store"
                await self._given_back(pool, why, exc, logging.CRITICAL)
                return False
            if rebuilt is None:  # created, never acknowledged anything: it does not exist
                logger.warning("pool %s has no journal in the cluster store: removed from the catalog", pool)
                await self.forget(pool)
                return False
            value, encoded, old_term, records = rebuilt
            assert self.prepare_pool is not None
            try:  # (off the loop too: decoding a large pool and building its engine held it for seconds)
                ready = await self.prepare_pool(value, encoded)
            except Exception as exc:  # noqa: BLE001 - loud, and the pool stays unserved here
                await self._given_back(pool, " was rebuilt from the cluster store but cannot be loaded", exc,
                                       logging.CRITICAL)  # fmt: skip
                return False
            if self.stopping or not await self._still_held(claim):
                ready.let_go(None)  # (its millions of objects freed off the loop)
                return False
            await self.load_pool(ready, claim.term)
            self.failovers += 1
            logger.warning(
                "took pool %s over from the cluster store (term %d after %d; %d records replayed)",
                pool, claim.term, old_term, records,
            )  # fmt: skip
            return True
        finally:
            self.adopting.discard(pool)
            view.moving.discard(pool)

    async def _given_back(self, pool: str, why: str, exc: BaseException, level: int = logging.ERROR) -> None:
        """Not served here for now (logged: "pool <pool><why>", and ``exc``): tried again in
        a lease, the claim given back meanwhile."""
        logger.log(level, "pool %s%s (tried again in %d s): %r", pool, why, self.lease_seconds, exc)
        self._retry_at[pool] = self.clock() + self.lease_seconds
        try:
            await self.release(pool)
        except Exception as again:  # noqa: BLE001 - recover_orphans releases it later
            logger.warning("pool %s: its claim could not be released: %r", pool, again)

    async def _still_held(self, claim: Claim) -> bool:
        """Whether ``claim`` is still this replica's in the store, under a lease it holds
        (see the module docstring); logged when not."""
        pool = claim.pool
        try:
            found = await self.client.get(self.key("owners", pool))
            holder = None if found is None else decode_claim(pool, found.value, found.mod_revision)
        except Exception as exc:  # noqa: BLE001 - unknown: not served; tried again later
            why = " was rebuilt from the cluster store, but its claim cannot be read there (not served)"
            await self._given_back(pool, why, exc)
            return False
        if holder == claim and self.view.lease_valid:
            return True
        logger.error(
            "pool %s was rebuilt from the cluster store for its claim at term %d, which ended meanwhile "
            "(now %s; this replica's lease %s): not served; taken over again at the next pass",
            pool, claim.term,
            "unclaimed" if holder is None else f"replica {holder.replica_id} at term {holder.term}",
            "valid" if self.view.lease_valid else "may have ended",
        )  # fmt: skip
        return False
