"""A journal found behind what clients were told while the server runs (a client's
proof, positions.py) or said to be by the operator (``kvcoord serve --restored``): what
a restore detected at start does, at once or once no pool is mid-Step."""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

from .durability import JournalRecorder
from .errors import ServiceError, Status
from .recovery import RestoreFenceError, fence_restored, void_earlier_instances
from .registry import PoolRegistry
from .startup import DataDirError, StartupDecision

__all__ = ["journal_behind"]

logger = logging.getLogger(__name__)


def journal_behind(registry: PoolRegistry, decision: StartupDecision, why: str) -> None:
    """A client proved the journal is behind what it was told (positions.py), or the
    operator said the data directory was restored (``--restored``): do what a restore
    detected at start does, and begin a grace period that survives restarts (written
    before the fencing's first record: once those are committed the journal no longer
    looks behind, so only grace.json keeps the grace across a crash).

    A grace that cannot be written (grace.json: a full disk, an I/O error) is held in
    memory only, nothing is fenced (its records would leave a journal that no longer
    looks behind, and no grace.json to bring the grace back after a crash: a restart
    would serve at once while workers of the lost history still hold their blocks), and
    the server stops serving (``decision.on_marker_failure``: exit 4, as after a failed
    lease-marker write), the call that proved it told UNAVAILABLE (its worker keeps the
    fence: its retry proves the restore again at the restart, the journal left as it
    was). (Before, the error escaped: the prover was told INTERNAL,
    nothing was fenced, no grace began, and a new worker attached at once and was
    handed the blocks the lost history's workers held.)

    Raises:
        ServiceError: INTERNAL when a prefix cache could not be emptied (RestoreFenceError);
            UNAVAILABLE when the grace cannot be written while serving.
        DataDirError: at start (``--restored``, no server to stop yet): grace.json cannot
            be written.
    """
    logger.critical(
        "the journal is behind what clients were told (%s): every session is ended, every fence "
        "void and every prefix cache reset; no session may attach for %.0f s",
        why, decision.max_lease,
    )  # fmt: skip
    recorder = registry.recorder
    assert isinstance(recorder, JournalRecorder)
    try:
        # grace.json names the generation the fencing begins: a restart that finds the
        # journal short of it (killed before the fencing committed) fences at start
        generation = registry.positions.generation + 1
        until = decision.begin_grace(f"journal behind what clients were told ({why})", generation)
        unwritten = None
    except OSError as exc:
        until, unwritten = decision.grace_until, exc  # (extended in memory before the write)
    registry.grace_until = until
    for service in registry.pools.values():
        service.grace_until = until
    if unwritten is not None:
        _grace_unwritten(decision, unwritten)
    # (grace.json's generation, when this journal is short of it by more than one: one
    # fencing begins it, not one per restart: JournalPositions.next_generation)
    at_least = decision.restore_generation
    if not registry.locks.any_busy():
        try:
            fence_restored(registry, recorder, at_least)
        except RestoreFenceError as exc:
            logger.critical("%s", exc)
            raise ServiceError(Status.INTERNAL, str(exc)) from None
        return
    # A Step is being applied in slices to some pool (pool_locks.py): ending its session
    # and resetting its pool now would let it go on allocating for a dead session, and
    # journal its call after that session's end (a record the next start cannot
    # replay). Every earlier fence is void at once (the grace runs already); the
    # sessions end once no pool is held (nothing awaits between wait_all's return and
    # the fencing, so no Step starts in between).
    void_earlier_instances(registry)
    task = asyncio.get_running_loop().create_task(_fence_when_idle(registry, recorder, at_least))
    registry.fencing = task  # (awaited before INSTANCE_CHANGED is told: PoolRegistry.fenced)
    _FENCING.add(task)
    task.add_done_callback(_FENCING.discard)


def _grace_unwritten(decision: StartupDecision, exc: OSError) -> NoReturn:
    """The grace of a restore found cannot be written: stop serving and refuse the call
    that proved it (UNAVAILABLE), or refuse the start. Nothing is fenced or journaled
    (:func:`journal_behind`)."""
    assert decision.grace_file is not None
    message = (
        f"a restore was found but its grace period cannot be written to {decision.grace_file.path} "
        f"({exc}): nothing is fenced, and no block is handed out; free space or fix the data "
        "directory, then restart (the first worker of the lost history proves the restore again)"
    )
    logger.critical("%s", message)
    if decision.on_marker_failure is None:  # at start: no server to stop yet
        raise DataDirError(message) from None
    decision.on_marker_failure(OSError(exc.errno, message))
    # not INSTANCE_CHANGED: a worker told that drops the fence that proved the restore,
    # and nothing durable remembers it; told UNAVAILABLE it keeps it, and its retry
    # proves the restore again at the restart
    raise ServiceError(Status.UNAVAILABLE, message)


#: fencings waiting for pools mid-Step (a reference keeps each task alive)
_FENCING: set[asyncio.Task[None]] = set()


async def _fence_when_idle(registry: PoolRegistry, recorder: JournalRecorder, at_least: int) -> None:
    await registry.locks.wait_all()
    try:
        fence_restored(registry, recorder, at_least)
    except RestoreFenceError as exc:
        logger.critical("%s", exc)
