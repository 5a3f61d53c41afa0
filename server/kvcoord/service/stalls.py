"""The stall policy of the server's durable writes ([server] journal_stall_seconds): a
journal commit (journal_writer.py) or a lease marker write (lease_marker.py) that has
not returned within the bound is taken as a hung disk or fsync, and the server stops as
after a failed write (exit 4, without waiting for the hung thread: main.py); a pool's
journal write to the cluster store (store_journal.py) not done within it gives the pool
up here, as a write the store refused does.

One rule for both: wait the bound, then once more at most :data:`PAUSE_SECONDS` (a
process paused past the bound, by SIGSTOP or a paused VM, has its timer and its writer
end together when it runs again: a write that returns then is taken, not called a stall).

A session's calls wait on such writes, so a lease must outlast the longest stall waited
out (:func:`tolerated_seconds`) inside the part of it the client trusts, ``(1 -
LEASE_MARGIN) x lease`` (kvcoord.wire.leases): :func:`lease_outlasts_stalls`, checked
for the default lease at start (config.py) and for a shorter one asked at Attach
(sessions.py). Else a stall the server tolerates answers a worker after its lease, and
the worker gives up its session and every request in it.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Coroutine
from typing import Any

from kvcoord.wire.leases import LEASE_MARGIN

from .tasks import cancel_and_wait

__all__ = [
    "PAUSE_SECONDS",
    "join_bounded",
    "lease_outlasts_stalls",
    "lease_rule",
    "max_bound_seconds",
    "min_lease_seconds",
    "run_bounded",
    "stalled_message",
    "tolerated_seconds",
    "wait_bounded",
]

#: the one more wait after the bound (at most the bound itself)
PAUSE_SECONDS = 1.0


def _pause(bound: float) -> float:
    return min(PAUSE_SECONDS, bound)


def tolerated_seconds(bound: float) -> float:
    """The longest a durable write is waited for under ``bound``: the bound and the
    pause allowance."""
    return bound + _pause(bound)


def lease_outlasts_stalls(lease: float, bound: float) -> bool:
    """True when the part of ``lease`` a client trusts outlasts every tolerated stall."""
    return lease * (1 - LEASE_MARGIN) > tolerated_seconds(bound)


def min_lease_seconds(bound: float) -> float:
    """A lease above this (rounded up to the millisecond) outlasts ``bound``'s stalls."""
    return math.ceil(tolerated_seconds(bound) / (1 - LEASE_MARGIN) * 1000) / 1000


def max_bound_seconds(lease: float) -> float:
    """A bound below this (rounded down to the millisecond) is outlasted by ``lease``."""
    trusted = lease * (1 - LEASE_MARGIN)
    bound = trusted - PAUSE_SECONDS if trusted > 2 * PAUSE_SECONDS else trusted / 2
    return math.floor(bound * 1000) / 1000


def lease_rule(bound: float) -> str:
    """The rule in words, for the errors that refuse a lease (numbers included)."""
    return (
        f"the {1 - LEASE_MARGIN:.0%} of a lease a client trusts must outlast the longest stall of a "
        f"durable write (journal, lease marker, cluster store) the server waits out: server.journal_stall_seconds "
        f"({bound:g} s) + {_pause(bound):g} s = {tolerated_seconds(bound):g} s"
    )


async def wait_bounded(work: asyncio.Future[Any], bound: float | None) -> bool:
    """Wait for ``work`` at most ``bound`` seconds and the pause allowance (None: for
    ever); True when it is done."""
    await asyncio.wait((work,), timeout=bound)
    if not work.done() and bound is not None:
        await asyncio.wait((work,), timeout=_pause(bound))
    return work.done()


async def run_bounded(coro: Coroutine[Any, Any, None], bound: float | None) -> bool:
    """Run ``coro`` as a task for at most ``bound`` seconds and the pause allowance:
    False once it is cancelled for not ending in time; its failure is raised, and a
    cancelled caller cancels it."""
    work = asyncio.ensure_future(coro)
    try:
        done = await wait_bounded(work, bound)
    except BaseException:
        work.cancel()
        raise
    if not done:
        await cancel_and_wait([work])
        return False
    work.result()
    return True


def join_bounded(thread: threading.Thread, bound: float | None, waited: float = 0.0) -> bool:
    """Join ``thread`` until ``bound`` seconds after it started its write (``waited``:
    how long ago that was) and the pause allowance (None: for ever); True when it ended."""
    if bound is None:
        thread.join()
        return True
    thread.join(max(0.0, bound - waited))
    if thread.is_alive():
        thread.join(_pause(bound))
    return not thread.is_alive()


def stalled_message(what: str, bound: float) -> str:
    """What the ERROR log and the callers' UNAVAILABLE say of a stalled write."""
    return f"{what} has not returned after {bound:g} s (server.journal_stall_seconds; a hung disk or fsync?)"
