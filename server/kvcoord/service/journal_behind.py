"""A journal found behind what clients were told while the server runs (a client's
proof, positions.py) or said to be by the operator (``kvcoord serve --restored``): what
a restore detected at start does, at once or once no pool is mid-Step."""

from __future__ import annotations

import asyncio
import logging

from .durability import JournalRecorder
from .errors import ServiceError, Status
from .recovery import RestoreFenceError, fence_restored, void_earlier_instances
from .registry import PoolRegistry
from .startup import StartupDecision

__all__ = ["journal_behind"]

logger = logging.getLogger(__name__)


def journal_behind(registry: PoolRegistry, decision: StartupDecision, why: str) -> None:
    """A client proved the journal is behind what it was told (positions.py), or the
    operator said the data directory was restored (``--restored``): do what a restore
    detected at start does, and begin a grace period that survives restarts (written
    before the fencing's first record: once those are committed the journal no longer
    looks behind, so only grace.json keeps the grace across a crash).

    Raises:
        ServiceError: INTERNAL when a prefix cache could not be emptied (RestoreFenceError).
    """
    logger.critical(
        "the journal is behind what clients were told (%s): every session is ended, every fence "
        "void and every prefix cache reset; no session may attach for %.0f s",
        why, decision.max_lease,
    )  # fmt: skip
    recorder = registry.recorder
    assert isinstance(recorder, JournalRecorder)
    until = decision.begin_grace(f"journal behind what clients were told ({why})")
    registry.grace_until = until
    for service in registry.pools.values():
        service.grace_until = until
    if not registry.locks.any_busy():
        try:
            fence_restored(registry, recorder)
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
    task = asyncio.get_running_loop().create_task(_fence_when_idle(registry, recorder))
    registry.fencing = task  # (awaited before INSTANCE_CHANGED is told: PoolRegistry.fenced)
    _FENCING.add(task)
    task.add_done_callback(_FENCING.discard)


#: fencings waiting for pools mid-Step (a reference keeps each task alive)
_FENCING: set[asyncio.Task[None]] = set()


async def _fence_when_idle(registry: PoolRegistry, recorder: JournalRecorder) -> None:
    await registry.locks.wait_all()
    try:
        fence_restored(registry, recorder)
    except RestoreFenceError as exc:
        logger.critical("%s", exc)
