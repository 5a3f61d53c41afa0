"""The server's lease clock: the monotonic clock less the time the server could not run.

A server can count a renewal only once it reads it. While its process is stopped (SIGSTOP,
a paused VM or container, a stalled host) or its event loop is held, the renewals its
clients keep sending wait unread in its sockets. Counted on the plain monotonic clock, a
pause longer than a lease ended, when the server ran again, every session whose renewals
were still unread: the reaper, or a call finding its own session past its lease, ran
before them, and workers that had renewed all along lost their sessions and every request.

So what the server ages by its clients' calls is counted on :class:`LeaseClock`: session
leases (sessions.py), routers' reservations (pool_reservations.py), the answers kept for
idempotency keys (idempotency.py; their window, like a lease, bounds how long a client's
retry may take to arrive). Not on it: the grace after a restart, set and read on the
registry's monotonic clock (``PoolService.grace_clock``: read on this one, every pause
since the start would lengthen a grace set later); a replica's cluster lease (ownership.py,
cluster_store.py), which etcd counts on its own clock whatever this process does; a paused
replica must count the pause there, and stop serving pools another may own now.

**What counts as a pause.** :func:`keep_ticking` reads the clock every
:data:`TICK_SECONDS` (0.1 s) on the event loop, and every other read counts too. A gap
between two reads longer than :data:`PAUSE_GAP_SECONDS` (0.5 s) is a pause: the server's
own work never holds the loop that long (calls and a session's end are cut into slices of
a few milliseconds: mutations.py, registry.py; a full garbage collection of a large pool
took about 50 ms before blocks were frozen out of it: gc_freezer.py), so such a gap is a
process that did not run, or a durable write held on the loop (lease_marker.py), during
which no renewal was read either. It is counted less the tick the loop would have slept
anyway, so the time counted never exceeds the time the loop could not run (save the
timer's slack, milliseconds). Shorter gaps (scheduling on a loaded machine) are not
counted: counting them would slow the clock all the time there, and a client renews every
third of its lease, so a gap that short costs no lease above 0.75 s a renewal. The first read after a gap counts it, whoever reads: a call answered
after a pause before the tick runs sees the pause too.

**What stays.** The lease clock never runs faster than the monotonic clock, so no session
ends earlier than it did before; a session whose client stopped renewing still ends one
lease of the server's running time after its last renewal was read (later than on the
monotonic clock by the pauses in between, and by nothing else). A client's own lease is
unchanged (kvcoord.client.session): it counts from its call's send on its own clock, so
a pause of the server only ever makes the server end a session later than the client
stops trusting it, never earlier. Nothing durable is counted on it: the lease marker
(lease_marker.py) and the grace kept across restarts (startup.py) are written on the
wall and monotonic clocks, and a session recovered after a restart is renewed then.

Plain Python; read on one thread (the server's event loop, where every reader is), save
:meth:`LeaseClock.peek`, which counts nothing (a pool rebuilt on a thread of its own,
store_rebuild.py, reads the time so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

__all__ = ["PAUSE_GAP_SECONDS", "TICK_SECONDS", "LeaseClock", "keep_ticking"]

logger = logging.getLogger(__name__)

#: how often :func:`keep_ticking` reads the clock
TICK_SECONDS = 0.1
#: a gap between two reads longer than this is a pause of the server (see above)
PAUSE_GAP_SECONDS = 0.5


class LeaseClock:
    """Monotonic seconds less every pause seen (a callable, as the clocks it replaces).

    Args:
        clock: the monotonic clock it reads.
        tick: how often :func:`keep_ticking` reads it (the part of a gap not counted).
        gap: the longest gap between two reads that is not a pause.

    Gaps are counted only while :attr:`ticking` (set by :func:`keep_ticking`): before it
    runs, at start-up, nothing reads the clock regularly and no renewal can arrive.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        tick: float = TICK_SECONDS,
        gap: float = PAUSE_GAP_SECONDS,
    ) -> None:
        if not 0 < tick < gap:
            raise ValueError(f"a lease clock needs 0 < tick < gap, got tick {tick:g}, gap {gap:g}")
        self.raw = clock
        self.tick = tick
        self.gap = gap
        #: seconds of pauses counted so far (the monotonic clock less this is the time)
        self.paused = 0.0
        #: pauses counted so far
        self.pauses = 0
        self.ticking = False
        self._last = clock()

    def __call__(self) -> float:
        now = self.raw()
        gap = now - self._last
        self._last = now
        if gap > self.gap and self.ticking:
            self.paused += gap - self.tick
            self.pauses += 1
            logger.warning(
                "the server did not run for %.2f s (a stopped process or VM, or its event loop held): "
                "session leases, reservations and kept answers are not counted down for it",
                gap,
            )
        return now - self.paused

    def peek(self) -> float:
        """The time now, the pauses counted so far taken off, counting none: safe to
        read on another thread while the loop reads the clock (a gap between two peeks
        is never a pause: the loop's own reads count those)."""
        return self.raw() - self.paused


async def keep_ticking(clock: LeaseClock) -> None:
    """Read ``clock`` every tick until cancelled, so that a gap between reads is a pause."""
    clock()  # (the gap since the last read, before ticking, is not a pause)
    clock.ticking = True
    try:
        while True:
            await asyncio.sleep(clock.tick)
            clock()
    finally:
        clock.ticking = False
