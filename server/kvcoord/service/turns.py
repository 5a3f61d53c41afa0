"""Work on a pool done a slice at a time on the event loop, the pool held
(pool_locks.py) from its first slice to its last: the rest of a large keyed call
(mutations.py) and a large session's end (Detach, a lease running out). Each turn lasts
at most ``slice_seconds``; between two, the loop pauses so that other pools' calls are
read and answered."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from .registry import PoolRegistry

__all__ = ["FREEZE_EVERY_SLICES", "SLICE_PAUSE", "SLICE_SECONDS", "PoolTurns"]

T = TypeVar("T")

#: the longest a sliced call (a large Step) holds the event loop at once, in seconds
SLICE_SECONDS = 0.002
#: seconds the loop waits between two slices of a sliced call (other calls are read then)
SLICE_PAUSE = 0.0005
#: slices between two freezes of what is alive (gc.freeze) in a sliced call
FREEZE_EVERY_SLICES = 16


class PoolTurns:
    """Runs work in turns for a registry (its pool locks read at each call).

    Args:
        registry: the pools and their locks.
    """

    def __init__(self, registry: PoolRegistry) -> None:
        self.registry = registry
        #: the longest a sliced call holds the event loop at once (0: a slice each
        #: mutations.SLICE_OPS operations)
        self.slice_seconds = SLICE_SECONDS

    async def in_turns(self, work: Generator[None, None, T], freeze: bool = False) -> T:
        """What ``work`` returns, run at most ``slice_seconds`` at a time between
        pauses for other calls; with ``freeze``, what is alive is frozen out of the
        cyclic collector every FREEZE_EVERY_SLICES slices."""
        end = time.perf_counter() + self.slice_seconds
        slices = 0
        while True:
            try:
                next(work)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if time.perf_counter() >= end:
                slices += 1
                if freeze and not slices % FREEZE_EVERY_SLICES:
                    # A large Step makes millions of objects (its requests' tokens):
                    # every full pass of the cyclic collector over them would hold the
                    # loop for 100-300 ms. Young garbage is collected and what is alive
                    # frozen, as gc_freezer.GcFreezer does for blocks.
                    gc.collect(1)
                    gc.freeze()
                # A real pause, not sleep(0): the loop thread then waits in select
                # without the GIL, so gRPC's poller thread can hand it other pools'
                # calls; with sleep(0) it took the GIL back at once and, on a quiet
                # machine, no other call was read until the Step ended.
                await asyncio.sleep(SLICE_PAUSE)
                end = time.perf_counter() + self.slice_seconds

    def start_holding(self, pool: str, work: Generator[None, None, T]) -> asyncio.Future[T]:
        """Run ``work``, a change to ``pool`` that is not a call of its own (a session's
        end: registry.py), holding the pool (pool_locks.py) from its first slice to its
        last: at once when the pool is free and the work ends within ``slice_seconds``
        (as a small call's apply), else in a task that serves other pools between
        slices (:meth:`in_turns`), as a large Step's rest, and that waits for the pool
        first when another holds it. Returns the future of what ``work`` returns (done
        already when it ran at once; an error raised at once is raised here)."""
        loop = asyncio.get_running_loop()
        locks = self.registry.locks
        if locks.busy(pool):
            return loop.create_task(self._holding(pool, work, False))
        end = time.perf_counter() + self.slice_seconds
        while True:
            try:
                next(work)
            except StopIteration as done:
                finished: asyncio.Future[T] = loop.create_future()
                finished.set_result(done.value)
                return finished
            if time.perf_counter() >= end:
                break
        locks.take(pool)  # (free: nothing awaited since it was looked at)
        return loop.create_task(self._holding(pool, work, True))

    async def _holding(self, pool: str, work: Generator[None, None, T], held: bool) -> T:
        """The rest of :meth:`start_holding`'s ``work``, the pool held (taken first unless
        ``held``), given back once it ends."""
        locks = self.registry.locks
        if not held:
            await locks.acquire(pool)
        try:
            return await self.in_turns(work, freeze=True)  # (a collector's full pass: 270 ms)
        finally:
            locks.give(pool)
