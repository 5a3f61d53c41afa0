"""vLLM's schedulers with kvcoord as their KV cache manager (needs vLLM 0.16.x or 0.33.x).

Use with vLLM's own option, the pool given by ``KVCOORD_*`` environment variables
(:class:`kvcoord.client.vllm.Settings`)::

    KVCOORD_TARGET=kvcoord:50051 KVCOORD_POOL=llama-8b PYTHONHASHSEED=0 \\
        vllm serve MODEL --scheduler-cls kvcoord.client.vllm_scheduler.KVCoordScheduler

``KVCoordAsyncScheduler`` is the same on vLLM's ``AsyncScheduler`` (``--scheduler-cls``
replaces vLLM's choice between the two, so pick the one matching ``--async-scheduling``).
The engine profiles memory and builds its ``KVCacheConfig`` as usual; the scheduler then
creates the pool from it (or attaches to an existing one, refusing a mismatch) and every
allocation decision is the pool's.

The pool's semantics profile follows the installed vLLM (:func:`vllm_profile`):
``vllm-0.16`` under vLLM 0.16.x, ``vllm-0.33`` under 0.33.x (then the manager is
:class:`kvcoord.client.vllm033.KVCoord033KVCacheManager`, and what kvcoord does not
reproduce for 0.33 is refused when the scheduler starts, with the reason); any other
release is refused at import (``UnsupportedVLLMError``).

A lost session (a partition longer than the lease, a server restarted without its
journal, an answer the manager could not settle) costs recomputation, never the
engine, under vLLM 0.16 and 0.33 alike: the requests the manager reports lost (``RequestsLostError``) are preempted as
vLLM preempts a request (blocks freed, computed tokens back to 0, back to the front of
the waiting queue) before the next allocation, and recomputed. While the server cannot
be reached, ``schedule()`` waits and tries again (at most ``KVCOORD_MAX_OUTAGE``
seconds). See "A lost session" in docs/vllm-integration.md for what happens to the
requests of a step the loss interrupts.

A KV connector may still be moving the KV of lost requests when the loss is met (an
asynchronous load into their blocks, or a finished request's KV being sent from them):
the worker uses those block ids until the connector reports the transfer ended, while
the server has freed them. Until every such transfer ends, ``schedule()`` schedules
nothing (the model runs empty steps, which carry the connector's reports), so no block
is handed to a request while a transfer still uses it; a transfer that does not end
within ``KVCOORD_MAX_OUTAGE`` seconds raises :class:`TransfersOutstandingError`.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from .errors import NotFoundError, RequestsLostError
from .vllm import OUTAGE_ERRORS, KVCoordKVCacheManager, Settings, connect, is_outage
from .vllm033 import VLLM_033, Unsupported033Error, connect_033, unsupported_033, vllm_profile
from .vllm_undo import Before, UndoCutShort

#: the semantics profile of the installed vLLM (UnsupportedVLLMError for another release)
PROFILE = vllm_profile()

__all__ = ["KVCoordAsyncScheduler", "KVCoordScheduler", "TransfersOutstandingError"]


logger = logging.getLogger(__name__)


#: schedule() calls in a row that may each be cut short by a loss before the error
#: reaches vLLM (each attempt preempts what it lost: more means something is wrong)
MAX_LOSSES_IN_A_ROW = 16
#: the first and the longest pause between attempts while the server is out of reach
OUTAGE_PAUSE = (0.05, 1.0)


class TransfersOutstandingError(RuntimeError):
    """A KV connector's transfers of requests a lost session held did not end within
    ``KVCOORD_MAX_OUTAGE`` seconds: scheduling cannot go on without handing out block
    ids the worker may still be writing or reading (named: the requests)."""

    def __init__(self, request_ids: set[str], seconds: float) -> None:
        self.request_ids = frozenset(request_ids)
        super().__init__(
            f"the KV connector still moves the KV of {len(request_ids)} request(s) a lost kvcoord session held "
            f"({', '.join(sorted(request_ids)[:5])}), {seconds:.0f} s after the loss: their blocks cannot be "
            "handed out again while in use"
        )


class _OnKVCoord(UndoCutShort):
    """Installs a kvcoord pool as the scheduler's ``kv_cache_manager`` and closes it."""

    kvcoord: KVCoordKVCacheManager
    waiting: Any
    running: list[Any]
    max_num_scheduled_tokens: int
    kv_cache_config: Any
    cache_config: Any
    vllm_config: Any
    log_stats: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        settings = Settings.from_env()
        self.kvcoord = self._connect(settings)
        # vLLM's own manager (built by Scheduler.__init__) holds nothing yet: drop it
        self.kv_cache_manager = self.kvcoord
        self.kvcoord_max_outage = settings.max_outage
        #: the scheduled steps whose output was not applied yet, oldest first: each
        #: one's ``num_scheduled_tokens`` (its requests; see :meth:`_outputs_in_flight`).
        #: Kept per step, not counted per request: a count per request costs two dict
        #: writes per running request and step, read only when a request is preempted here
        self._in_flight: collections.deque[dict[str, int]] = collections.deque()
        #: requests preempted here (not by vLLM's own schedule()), for the next output's
        #: preempted_req_ids; and those of them that wait for outputs in flight
        self._preempted_here: set[str] = set()
        self._recovering: set[str] = set()
        #: since the scheduler was made: requests preempted here (lost, or allocated
        #: for by a schedule() call cut short), schedule() calls cut short and made
        #: again, and outages waited for
        self.kvcoord_preempted = 0
        self.kvcoord_undone = 0
        self.kvcoord_outages = 0
        #: requests whose KV the connector was moving when a session was lost, until
        #: each transfer ends (scheduling pauses meanwhile: see _transfers_pending), and
        #: when the pause began; the schedule() calls it emptied
        self._transfers: set[str] = set()
        self._paused_since: float | None = None
        self.kvcoord_paused_steps = 0
        #: (vLLM 0.33, frees deferred behind steps in flight) the last step scheduled
        #: when a session was lost: nothing is allocated until it is processed
        self._loss_fence = 0

    def _refuse_unsupported(self) -> None:
        """Raise, naming the reason, for an engine kvcoord does not reproduce (none of
        0.16's); warn of vLLM 0.16's own defects: one that recovering from a lost session
        makes frequent, and one kvcoord refuses (docs/vllm-integration.md, "What is not
        supported")."""
        groups = self.kv_cache_config.kv_cache_groups
        if self.cache_config.enable_prefix_caching and any(
            str(getattr(g.kv_cache_spec, "mamba_cache_mode", "")) == "align" for g in groups
        ):
            logger.warning(
                "kvcoord: vLLM 0.16 with a mamba 'align' group and prefix caching can cache a resumed "
                "request's mamba state under a later position (vLLM's defect, fixed in 0.33), and "
                "kvcoord's recovery from a lost session (its requests preempted) makes it frequent: "
                "use vLLM 0.33, or turn prefix caching off"
            )
        if (
            self.cache_config.enable_prefix_caching
            and getattr(self.vllm_config, "kv_transfer_config", None) is not None
            and len(groups) > 1
        ):
            logger.warning(
                "kvcoord: vLLM 0.16 with a KV connector and %d KV cache groups can put one block in two "
                "groups' tables (a group's blocks for a connector's tokens taken before a later group's "
                "cached hit block is claimed: vLLM's defect, fixed in 0.33); kvcoord refuses such an "
                "allocation (HIT_BLOCK_TAKEN) and schedule() raises it: use vLLM 0.33",
                len(groups),
            )

    def _connect(self, settings: Settings) -> KVCoordKVCacheManager:
        """The manager on the configured pool."""
        return connect(settings, self.kv_cache_config, self.vllm_config, log_stats=self.log_stats)

    # -- a lost session costs recomputation ----------------------------------------------
    def schedule(self) -> Any:
        """vLLM's schedule(), after preempting the requests the manager reported lost.
        A call cut short by a loss is undone and made again; one cut short by an outage
        is undone and made again once the server answers (see _undo)."""
        manager = self.kvcoord
        losses = 0
        outage_since: float | None = None
        pause = OUTAGE_PAUSE[0]
        while True:
            # (each step's fixed work, most steps with nothing to do: the calls made only
            # when there is, a few Python calls and empty sets and lists fewer a step)
            if manager.lost:
                self._preempt_lost(manager.take_lost())
            held = self._hold_back() if self._recovering else []
            before = Before(self)
            manager.allocated.clear()
            manager.seen.clear()
            try:
                met = self._losses_met()
                if met:
                    self._preempt_lost(met)
                out = self._schedule_nothing() if self._transfers_pending() else super().schedule()  # type: ignore[misc]
            except (RequestsLostError, *OUTAGE_ERRORS) as err:
                lost = isinstance(err, RequestsLostError)
                if not lost and not is_outage(err):
                    raise  # a refusal no wait changes (REQUEST_UNKNOWN): vLLM's, at once
                lost_ids: set[str] = set(err.request_ids) if isinstance(err, RequestsLostError) else set()
                self._undo(before, lost_ids, held)
                cause = err.cause if isinstance(err, RequestsLostError) else err
                if lost:  # (after the undo, which would put back what it changes)
                    self._lost_during_transfers(lost_ids)
                    # (was silent: the undo preempts them, and a lapsed lease read as a
                    # difference in what the engine did, not as the loss it was)
                    logger.warning(
                        "kvcoord: %d request(s) lost during schedule() (%s): preempted, to be recomputed",
                        len(lost_ids), cause,
                    )  # fmt: skip
                outage = is_outage(cause)
                if lost:
                    losses += 1
                    if not outage and losses > MAX_LOSSES_IN_A_ROW:
                        raise  # e.g. answers that keep differing: something is wrong
                    if not outage or losses == 1:
                        self._pool_gone(cause)
                        continue  # what it lost is preempted: try again at once
                # the server is out of reach, restarted without the pool, or still holds
                # a session: wait for it (at most max_outage)
                now = time.monotonic()
                if outage_since is None:
                    outage_since = now
                    self.kvcoord_outages += 1
                    logger.warning("kvcoord: %s; scheduling waits for the server", err)
                if now - outage_since > self.kvcoord_max_outage:
                    raise
                if not self._pool_gone(cause):
                    time.sleep(pause)
                    pause = min(pause * 2, OUTAGE_PAUSE[1])
                continue
            if held:
                self._put_back(held)
            break
        if self._preempted_here:
            out.preempted_req_ids = set(out.preempted_req_ids or ()) | self._preempted_here
            self._preempted_here = set()
        if out.num_scheduled_tokens:
            self._in_flight.append(out.num_scheduled_tokens)
        manager.scheduled()  # the model runs now: the Step cut last goes meanwhile
        return out

    def _losses_met(self) -> set[str]:
        """Requests lost that the manager learns of only when asked (none here: a loss
        raises in the call that meets it)."""
        return set()

    # -- a loss while a KV connector moves KV -------------------------------------------
    def _transfers_in_flight(self) -> set[str]:
        """The requests whose blocks the KV connector uses now: an asynchronous load not
        reported ended, or a finished request whose free waits for its KV to be sent."""
        if getattr(self, "connector", None) is None:
            return set()
        ended = self.finished_recving_kv_req_ids  # type: ignore[attr-defined]
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        return {
            rid for rid, r in self.requests.items()  # type: ignore[attr-defined]
            if r.is_finished() or (r.status == waiting and rid not in ended)
        }  # fmt: skip

    def _lost_during_transfers(self, lost: set[str]) -> None:
        """What a loss does to requests that are not running: scheduling pauses until
        every KV transfer now in flight ends (those of requests not lost too: a loss
        names the requests it meets, the pause costs a few empty steps). A lost request
        waiting for its load is marked as a failed load, for recomputation (vLLM's own
        handling of one): the blocks it loads into are no longer its own; a lost waiting
        request that holds computed tokens (a load ended, not yet scheduled) computes
        them again."""
        connector = getattr(self, "connector", None) is not None
        if connector:
            self._transfers |= self._transfers_in_flight()
        if getattr(self, "defer_block_free", False):
            # vLLM 0.33 holds a freed block until every step that may still write it is
            # processed (a KV consumer's asynchronous load into it would not be ordered
            # with the GPU stream); the server freed the lost requests' blocks at once:
            # nothing is allocated until the steps scheduled so far are processed
            self._loss_fence = max(self._loss_fence, self.sched_step_seq)  # type: ignore[attr-defined]
        requests = self.requests  # type: ignore[attr-defined]
        # (vLLM 0.33) prefills in flight keep a reservation of the blocks they still need,
        # asked of the manager each step; a lost one holds none and is computed again, as
        # after vLLM's own preemption, which drops it from them
        inflight = getattr(self, "_inflight_prefills", None)
        for rid in lost:
            request = requests.get(rid)
            if request is None or request.status == RequestStatus.RUNNING:
                continue
            if inflight is not None:
                inflight.discard(request)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and connector:
                request.num_computed_tokens = 0
                self.failed_recving_kv_req_ids.add(rid)  # type: ignore[attr-defined]
            elif not request.is_finished() and request.num_computed_tokens:
                request.num_computed_tokens = 0

    def _transfers_pending(self) -> bool:
        """Whether a transfer the last loss met still runs (then nothing may be
        allocated: the server gave its blocks back to the pool, the worker still uses
        them), or a step that may still write them (vLLM 0.33's deferred frees). Raises
        TransfersOutstandingError once a transfer's pause outlasts max_outage."""
        if self._loss_fence > getattr(self, "processed_step_seq", 0):
            return True  # (empty steps: the steps in flight are processed meanwhile)
        if not self._transfers:
            return False
        self._transfers &= self._transfers_in_flight()
        if not self._transfers:
            logger.warning("kvcoord: the KV transfers of the lost requests ended: scheduling resumes")
            self._paused_since = None
            return False
        now = time.monotonic()
        if self._paused_since is None:
            self._paused_since = now
            logger.warning(
                "kvcoord: the KV connector still moves the KV of %d lost request(s): nothing is scheduled until "
                "those transfers end (their blocks are free on the server, in use on the worker)",
                len(self._transfers),
            )  # fmt: skip
        elif now - self._paused_since > self.kvcoord_max_outage:
            raise TransfersOutstandingError(self._transfers, now - self._paused_since)
        return True

    def _schedule_nothing(self) -> Any:
        """vLLM's schedule() with no token to schedule: an empty step, whose model
        output carries the connector's reports (vLLM's own pause does the same)."""
        self.kvcoord_paused_steps += 1
        budget = self.max_num_scheduled_tokens
        self.max_num_scheduled_tokens = 0
        try:
            return super().schedule()  # type: ignore[misc]
        finally:
            self.max_num_scheduled_tokens = budget

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's update_from_output(); a loss or an outage met in it is kept for the next
        schedule() (the step's outputs are delivered: the tokens were sampled)."""
        in_flight = self._in_flight
        if in_flight:
            scheduled = scheduler_output.num_scheduled_tokens
            if in_flight[0] is scheduled:  # (outputs come in the order of their steps)
                in_flight.popleft()
            else:
                self._output_applied(scheduled)
        manager = self.kvcoord
        manager.absorbing = True
        try:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        finally:
            manager.absorbing = False

    def _output_applied(self, scheduled: dict[str, int]) -> None:
        """The step that scheduled ``scheduled`` is no longer in flight: the first one
        scheduling it (the same dict, else an equal one: a copy of the output), if any."""
        in_flight = self._in_flight
        for i, step in enumerate(in_flight):
            if step is scheduled:
                del in_flight[i]
                return
        for i, step in enumerate(in_flight):
            if step == scheduled:
                del in_flight[i]
                return

    def _outputs_in_flight(self, rid: str) -> int:
        """How many scheduled steps of the request have an output not applied yet."""
        return sum(rid in step for step in self._in_flight)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        """vLLM's finish_requests(), which its engine core calls between steps (a client
        gone, a stop string the frontend met): an exception there ends the engine. A
        loss or an outage met in it (the first call to see a session the server ended)
        is kept for the next schedule(), as in update_from_output(); the request is
        finished either way (a lost request's blocks went with its session)."""
        manager = self.kvcoord
        was, manager.absorbing = manager.absorbing, True
        try:
            return super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        finally:
            manager.absorbing = was

    def _pool_gone(self, err: Exception) -> bool:
        """A server that lost the pool (restarted empty): create it again if allowed."""
        if type(err) is NotFoundError:  # the pool (a session or request has its own reason)
            return self.kvcoord.create_pool_again()
        return False

    def _preempt(self, request: Any, timestamp: float) -> None:
        """vLLM's preemption (blocks freed, computed tokens back to 0, to the front of
        the waiting queue), named in the next output's preempted_req_ids. The request is
        not marked scheduled in the previous step, so its resumption sends all its tokens."""
        self._preempt_request(request, timestamp)  # type: ignore[attr-defined]
        self._preempted(request.request_id)
        self.kvcoord_preempted += 1

    def _preempted(self, rid: str) -> None:
        """A request preempted in this call: named in the next output, held back while
        an output of it is in flight (:meth:`_hold_back`), resumed with all its tokens."""
        self._preempted_here.add(rid)
        if self._outputs_in_flight(rid):
            self._recovering.add(rid)
        self.prev_step_scheduled_req_ids.discard(rid)

    def _preempt_lost(self, lost: set[str]) -> None:
        """Preempt the running requests among ``lost`` (before any allocation: the blocks
        they held may be given to others now). A waiting request holds no blocks, or
        (waiting for a KV connector's load) is left to the connector, and scheduling
        pauses until its load (or a finished request's send) ends."""
        if not lost:
            return
        self._lost_during_transfers(lost)
        victims = [r for r in self.running if r.request_id in lost]
        if not victims:
            return
        logger.warning("kvcoord: %d running request(s) lost: preempted, to be recomputed", len(victims))
        self.running = [r for r in self.running if r.request_id not in lost]
        now = time.monotonic()
        for request in reversed(victims):  # the first ends at the front, as vLLM's order
            self._preempt(request, now)

    def _hold_back(self) -> list[Any]:
        """Requests preempted here whose outputs are still in flight leave the waiting
        queue for one schedule() call: one resumed before its output is applied would
        compute the position that output fills (vLLM never resumes a request in the
        step that preempts it)."""
        if not self._recovering:
            return []
        ids = self._recovering
        held = [r for r in self.waiting if r.request_id in ids and self._outputs_in_flight(r.request_id)]
        self._recovering = {r.request_id for r in held}
        if held:
            self.waiting.remove_requests(held)
        return held

    def _put_back(self, held: list[Any]) -> None:
        for request in reversed(held):
            if not request.is_finished():
                self.waiting.prepend_request(request)

    def shutdown(self) -> None:
        """vLLM's shutdown(), then the session ends."""
        super().shutdown()  # type: ignore[misc]
        try:
            self.kvcoord.close()
        except (RequestsLostError, *OUTAGE_ERRORS) as err:
            # the session is gone or out of reach: the server frees it when its lease ends
            logger.warning("kvcoord: the session did not end cleanly: %s", err)


class _OnKVCoord033(_OnKVCoord):
    """Installs a ``vllm-0.33`` kvcoord pool as a vLLM 0.33 scheduler's ``kv_cache_manager``.

    Refuses at start, naming the reason, an engine whose configuration kvcoord does not
    reproduce for 0.33 (:func:`unsupported_033`), or whose scheduler defers asynchronous
    loads behind load fences (``defer_async_loads``, whatever set it). A lost session and an outage cost
    recomputation as under 0.16 (:class:`_OnKVCoord`): losses met between steps (a Step
    sent in the background that failed, a lease that ran out) are asked of the manager
    before each ``schedule()`` (``surface_losses``) and the running requests lost are
    preempted with vLLM 0.33's own preemption (which accounts for their outputs in
    flight); a ``schedule()`` cut short by a loss or an outage is undone and made again."""

    kvcoord: Any
    hash_block_size: int

    def _refuse_unsupported(self) -> None:
        why = unsupported_033(self.kv_cache_config, self.vllm_config, self.hash_block_size)
        if why is None and getattr(self, "defer_async_loads", False):
            # (0.33.0 sets it only with a HiSparse host pool, refused above; this is the
            # flag itself, whatever set it)
            why = (
                "asynchronous loads deferred behind load fences (the scheduler's defer_async_loads): "
                "not supported: vLLM then tells the KV connector to load only in a later "
                "update_from_output (_drain_deferred_loads), and kvcoord's recovery from a lost "
                "session knows an admitted load only by its request's status"
            )
        if why is not None:
            raise Unsupported033Error(f"kvcoord cannot be this vLLM 0.33 engine's KV cache manager: {why}")

    def _connect(self, settings: Settings) -> KVCoordKVCacheManager:
        return connect_033(
            settings, self.kv_cache_config, self.vllm_config, self.hash_block_size, log_stats=self.log_stats
        )

    def _losses_met(self) -> set[str]:
        """The requests lost since the last step, a loss the predicted session met in the
        background included (raises an outage: the server cannot be reached)."""
        lost: set[str] = self.kvcoord.surface_losses()
        return lost


if PROFILE == VLLM_033:

    class KVCoordScheduler(_OnKVCoord033, Scheduler):
        """vLLM 0.33's ``Scheduler``; its ``kv_cache_manager`` is a ``vllm-0.33`` kvcoord pool."""

    class KVCoordAsyncScheduler(_OnKVCoord033, AsyncScheduler):
        """vLLM 0.33's ``AsyncScheduler``; its ``kv_cache_manager`` is a ``vllm-0.33`` kvcoord pool."""

else:

    class KVCoordScheduler(_OnKVCoord, Scheduler):  # type: ignore[no-redef]
        """vLLM's ``Scheduler``; its ``kv_cache_manager`` is a kvcoord pool."""

    class KVCoordAsyncScheduler(_OnKVCoord, AsyncScheduler):  # type: ignore[no-redef]
        """vLLM's ``AsyncScheduler``; its ``kv_cache_manager`` is a kvcoord pool."""
