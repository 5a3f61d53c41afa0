"""One lock per pool, held while a Step is applied in slices.

A large Step is applied a slice at a time, the event loop serving other pools
between slices (mutations.py); so is a large allocation (an Allocate call, or an
AllocateOp of a Step, of at least pool_allocations.SLICED_ALLOCATE_TOKENS tokens: its
blocks are taken and cached 256 at a time, engine.KVCachePool.allocating_slots), a long
DecodeOp (pool_allocations.DECODE_SLICE_ENTRIES entries at a time) and the end of a
session owning many requests (Detach, lease expiry: MutationRunner.start_holding,
registry.END_SLICE_REQUESTS requests at a time); so is a pool being deleted, from its
checks (an exclusive session refuses it) to its removal (pool_calls.py). Meanwhile
nothing else may read or change that pool: every call naming it waits for the lock first (servicer.py's guard), keyed
calls hold it while they apply (so calls on one pool still run one at a time, in
arrival order), and what reads every pool (ListPools, ScorePools, a metrics
scrape, a snapshot, the session reaper) waits, or is put off, until no pool is
mid-Step. A snapshot is such a reader: one that falls due while a pool is held is
put off, and :attr:`PoolLocks.on_idle` lets it be taken once no pool is (else a
workload whose every record is appended with its pool held, a Step applied in slices,
would never be snapshotted). Plain asyncio; no gRPC.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

__all__ = ["PoolLocks"]


class PoolLocks:
    """Which pools a sliced Step holds now, and the calls waiting for each.

    A pool is held from :meth:`take` (made without awaiting, right after the call
    found the pool free) to :meth:`give`, which hands it to the oldest waiter, so
    calls on a pool keep their arrival order."""

    def __init__(self) -> None:
        #: pool -> the futures of the calls waiting for it (present while it is held)
        self._held: dict[str, deque[asyncio.Future[None]]] = {}
        #: called on the loop soon after the last held pool is given back (the registry
        #: tells its recorder: a snapshot put off meanwhile is taken then)
        self.on_idle: Callable[[], None] | None = None
        #: the futures of the :meth:`wait_all` callers, resolved once no pool is held
        self._idle: list[asyncio.Future[None]] = []

    def take(self, pool: str) -> None:
        """Hold ``pool`` (free now: the caller awaited :meth:`wait` and has not
        awaited since)."""
        if pool in self._held:
            raise RuntimeError(f"pool {pool!r} is held already")  # pragma: no cover - a bug
        self._held[pool] = deque()

    def give(self, pool: str) -> None:
        """Stop holding ``pool``: the oldest waiter holds it now, else nobody."""
        waiters = self._held[pool]
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # (a waiter cancelled meanwhile is skipped)
                waiter.set_result(None)
                return
        del self._held[pool]
        if not self._held:
            idle, self._idle = self._idle, []
            for waiter in idle:
                if not waiter.done():  # (a caller cancelled meanwhile is skipped)
                    waiter.set_result(None)
        if not self._held and self.on_idle is not None:
            # Soon, not now: a call applied at once gives its pool back just before it
            # journals its change (mutations.py), and a snapshot taken in between would
            # hold the change without its record.
            asyncio.get_running_loop().call_soon(self.on_idle)

    async def acquire(self, pool: str) -> None:
        """Hold ``pool`` once the calls before this one are done with it."""
        waiters = self._held.get(pool)
        if waiters is None:
            self.take(pool)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give(pool)  # handed over as this call was cancelled: pass it on
            raise

    async def wait(self, pool: str) -> None:
        """Return once ``pool`` is not held (at once when it is not), in turn with the
        calls that waited before; the caller then runs on without awaiting, so nothing
        else touches the pool before it does."""
        if pool in self._held:
            await self.acquire(pool)
            self.give(pool)

    async def wait_all(self) -> None:
        """Return once no pool is held.

        Not by taking a turn in each pool's queue (:meth:`wait`): two callers queued on
        one held pool would each be handed it and hand it to the other, forever, and the
        pool would never be free. The callers wait aside instead, and :meth:`give`
        resolves them all when it frees the last held pool (one taken again before a
        caller runs on makes it wait again: the loop checks)."""
        while self._held:
            idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle.append(idle)
            await idle

    def busy(self, pool: str) -> bool:
        """Whether ``pool`` is held now (a Step is applied to it in slices)."""
        return pool in self._held

    def waiting(self, pool: str) -> int:
        """How many calls wait for ``pool`` now (0 when it is not held)."""
        return sum(1 for w in self._held.get(pool, ()) if not w.done())

    def any_busy(self) -> bool:
        """Whether some pool is held now."""
        return bool(self._held)
