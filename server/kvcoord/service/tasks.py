"""Ending background tasks at stop, and noticing a stop that an await lost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended.

    Not ``await task`` under ``suppress(CancelledError)``: that cannot tell a task's
    cancellation from one of the caller's own, and takes the caller's for the task's
    (the caller then goes on as if nothing happened). Here a cancelled caller is
    cancelled. A task's failure was logged where it happened; it is read here so that
    asyncio does not report it again.
    """
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()


def raise_if_cancelled() -> None:
    """Raise CancelledError when the current task was asked to stop (cancelled) but
    the await it was in returned anyway.

    ``asyncio.wait_for`` on Python 3.11 does that when what it waits for comes in the
    same loop turn as the cancellation: it returns the result, and the cancellation is
    lost (a loop then runs on, and whoever cancelled it waits forever). Our own code
    uses ``asyncio.timeout`` instead; call this after awaiting a library that uses
    ``wait_for`` (aetcd's watch_prefix).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
