"""What every part of the Allocator servicer shares: the registry, the observer, access
control, the mutation runner, the journal-failure switch, the wait for pools busy
with a sliced Step, and a pool's info as the caller may see it. The handlers are
grouped by role in :mod:`.pool_calls`, :mod:`.session_calls`, :mod:`.observing_calls`,
:mod:`.routing_calls` and :mod:`.servicer` (the operations)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from google.protobuf.message import Message
from kvcoord.v1 import allocator_pb2 as pb

from .access import AccessControl, current_tenant
from .convert import fence_from_pb, fence_to_pb
from .durability import Recorder
from .errors import STOPPING_AFTER_JOURNAL_FAILURE, ServiceError, Status
from .mutating_calls import STEP, apply_step, step_slices
from .mutations import MutationRunner
from .observers import NullObserver, OperationObserver
from .pool_service import Fence, PoolService, drain
from .registry import PoolRegistry
from .rpc_guard import pool_named
from .score_wire import ScoreEncoder
from .step_stream import StepStreams

__all__ = ["ServicerCore", "fence_of"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


def fence_of(request: Any) -> Fence | None:
    """The fence a request carries (None: none)."""
    return fence_from_pb(request.fence, request.HasField("fence"))


class ServicerCore:
    """The servicer's shared state and helpers (see the module's docstring)."""

    def __init__(
        self,
        registry: PoolRegistry,
        observer: OperationObserver | None = None,
        watch_poll_seconds: float = 1.0,
        access: AccessControl | None = None,
        max_message_bytes: int = 0,
    ) -> None:
        self.registry = registry
        self.observer: OperationObserver = observer or NullObserver()
        registry.on_session_expired = self._session_expired
        registry.on_removed = self._tear_down
        registry.run_expiry = self._run_expiry
        self.watch_poll_seconds = watch_poll_seconds
        self.stopping = False
        #: the open StepStream calls (step_stream.py), ended when the server stops
        self.step_streams = StepStreams()
        #: set when the journal could not be written: every call is refused from then on
        self.journal_failure: str | None = None
        #: pools released, and sessions' requests freed, in slices (settled by teardowns_done)
        self._teardowns: set[asyncio.Future[Any]] = set()
        #: pool -> the end of its lapsed session freed last in slices (an Attach waits for it)
        self.expiring: dict[str, asyncio.Future[Any]] = {}
        #: who may call what (every caller has full access when none is given)
        self.access = access or AccessControl((), (), registry.sessions)
        #: the gRPC receive limit, reported in GetStats
        self.max_message_bytes = max_message_bytes
        #: runs the keyed calls (idempotency, journal, commit wait)
        self.mutations = MutationRunner(registry, max_message_bytes)
        #: ScorePools answers without block ids, encoded from parts kept per pool
        self._score_encoder = ScoreEncoder(4 * registry.limits.max_pools)
        #: the Step mutation, observed (engine time, operations, event gaps) for metrics
        self._step = dataclasses.replace(
            STEP,
            apply=functools.partial(apply_step, observer=self.observer),
            slices=functools.partial(step_slices, observer=self.observer),
        )

    def _info(self, p: PoolService) -> pb.PoolInfo:
        """The pool as the caller may see it (other tenants' names only to its administrators)."""
        return pb.PoolInfo(
            name=p.name,
            config=self.access.pool_config_for(current_tenant(), p.name, p.wire_config),
            coordinator=p.config.coordinator_kind,
            num_free_blocks=p.num_free_blocks,
            usage=p.usage,
            num_requests=p.num_requests,
            fence=fence_to_pb(p.fence),
            replica=self.registry.placement.replica_id,
            replica_name=self.registry.placement.name,
        )

    async def restore_fenced(self) -> None:
        """Awaited before a call is told INSTANCE_CHANGED (errors.map_errors): see
        :meth:`PoolRegistry.fenced`."""
        await self.registry.fenced()

    async def sessions_ended(self) -> None:
        """Awaited before a call is told SESSION_EXPIRED (errors.map_errors): every lapsed
        session's end begun so far (the call's own session's, ended as it was found run
        out: SessionTable.on_lapsed, or the reaper's) journaled and durable. Told before,
        a crash would bring the session and its requests back on a fresh lease: its
        worker told they were freed, an exclusive pool refusing the worker's new Attach.

        Raises:
            Exception: what ending one raised (logged by the servicer too), or the
                journal's failure; the call is told that instead.
        """
        for ending in list(self.expiring.values()):
            await asyncio.shield(ending)  # (holding their pools in turn: the last one ends last)
        await self.mutations.committed()

    async def _durable(self, response: M, record: Callable[[Recorder], None] | None = None) -> M:
        """Journal the call (``record``), then answer once every mutation so far is
        durable (mutations.py)."""
        return await self.mutations.durable(response, record)

    def journal_failed(self, exc: BaseException) -> None:
        """Refuse every later call (UNAVAILABLE): state in memory is ahead of the disk, so
        neither a mutation nor a read of it may be answered (the server then exits)."""
        self.journal_failure = str(exc)

    def check_serving(self) -> None:
        """Raises:
        ServiceError: UNAVAILABLE once the journal failed (:meth:`journal_failed`).
        """
        if self.journal_failure is not None:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"journal write failed ({self.journal_failure}); {STOPPING_AFTER_JOURNAL_FAILURE}",
            )

    async def wait_for_pools(self, request: Any) -> None:
        """Return once no Step is applied in slices to a pool the call may touch (the
        pool it names, the pool of the session it names, else every pool); the handler
        then runs on without awaiting before it reads or changes that pool."""
        locks = self.registry.locks
        if not locks.any_busy():
            return
        pool = pool_named(request, self.registry)
        if pool is None:
            await locks.wait_all()
        else:
            await locks.wait(pool)

    def reap_expired_sessions(self) -> int:
        """Free the requests of every session whose lease ran out."""
        if self.journal_failure is not None or self.registry.locks.any_busy():
            return 0  # (a pool mid-Step: the next round reaps them)
        return self.registry.reap_expired_sessions()

    def _run_expiry(self, pool: str, work: Generator[None, None, Any]) -> None:
        """End a lapsed session (registry.expiring) as a call would change its pool: a
        session owning many requests (65,536 held the loop 275 ms at once) has them freed
        a slice at a time, its pool held and other pools served between slices; it is
        journaled as expired once they all are (a crash before: replay still has it,
        and it expires again). Nobody waits for it (an Attach waits for the pool)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # (no loop: nothing else could run meanwhile)
            drain(work)
            return
        ending = self.mutations.start_holding(pool, work)
        if not ending.done():
            self._teardowns.add(ending)
            self.expiring[pool] = ending  # (ends after those before it: they hold the pool in turn)
            ending.add_done_callback(functools.partial(self._expiry_ended, pool))

    def _expiry_ended(self, pool: str, ending: asyncio.Future[Any]) -> None:
        self._teardowns.discard(ending)
        if self.expiring.get(pool) is ending:
            del self.expiring[pool]
        if not ending.cancelled() and ending.exception() is not None:
            logger.error("ending a lapsed session failed", exc_info=ending.exception())

    def _tear_down(self, service: PoolService) -> None:
        """A pool removed from the registry (deleted, handed over, dropped, replaced) is
        released a slice at a time between other calls: freeing millions of used blocks
        at once would stall every pool. With no loop running, nothing is done here: the
        objects are left to reference counting and the collector, as before."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(_release_slices(service))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    def _session_expired(self, pool: str) -> None:
        self.observer.detached(pool)
        self.observer.session_expired(pool)


async def _release_slices(service: PoolService) -> None:
    for _ in service.teardown():
        await asyncio.sleep(0)
