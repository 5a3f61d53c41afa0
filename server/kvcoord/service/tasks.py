"""Ending background tasks at stop."""

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
