"""Ending background tasks at stop; telling a call's cancellation that its task was not asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


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


class CallCancelled(Exception):
    """A call ended in a cancellation its task was not asked for (see :func:`uncancelled`)."""


async def uncancelled(call: Awaitable[T]) -> T:
    """Await a store call; a :class:`asyncio.CancelledError` that the running task
    was not asked for (``cancelling()`` is 0: no ``cancel()``, no timeout) is raised as
    :class:`CallCancelled`, an ordinary failure the caller retries. gRPC raises
    CancelledError from a call whose channel is closed under it: a client the replica
    replaced (:meth:`.cluster_store.ClusterStore.reconnect`) is closed once its calls'
    deadlines passed, and on a loaded machine a call's end by its deadline reached the
    loop after that close. Taken for the task's own cancellation, it gave a pool up
    (store_journal.py) where the same write on the new client was all it needed."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        raise CallCancelled("the call was cancelled under its task (its channel was closed)") from None
