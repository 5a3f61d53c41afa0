"""The stall policy of the server's durable writes ([server] journal_stall_seconds): a
journal commit (journal_writer.py) or a lease marker write (lease_marker.py) that has
not returned within the bound is taken as a hung disk or fsync, and the server stops as
after a failed write (exit 4, without waiting for the hung thread: main.py); a pool's
journal write to the cluster store (store_journal.py) not done within it gives the pool
up here, as a write the store refused does.

One rule for both: wait the bound, then once more at most :data:`PAUSE_SECONDS` (a
process paused past the bound, by SIGSTOP or a paused VM, has its timer and its writer
end together when it runs again: a write that returns then is taken, not called a stall).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from .tasks import cancel_and_wait

__all__ = ["PAUSE_SECONDS", "join_bounded", "run_bounded", "stalled_message", "wait_bounded"]

#: the one more wait after the bound (at most the bound itself)
PAUSE_SECONDS = 1.0


def _pause(bound: float) -> float:
    return min(PAUSE_SECONDS, bound)


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
