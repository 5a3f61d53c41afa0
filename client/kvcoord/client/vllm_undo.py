"""Undoing a vLLM ``schedule()`` call that a lost kvcoord session or an outage cut short
(the scheduler's half: :class:`~kvcoord.client.vllm_scheduler.KVCoordScheduler` makes
the call again; see "A lost session" in docs/vllm-integration.md)."""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.request import RequestStatus

__all__ = ["Before", "UndoCutShort"]


class Before:
    """What a schedule() call may change before a manager call fails in it: the queues
    and the ids of the previous step (the fields of the requests it looks up or
    allocates for are kept by the manager, at their first such call: ``seen``); under
    vLLM 0.33 also the queue of waiting requests that hold blocks (drained first), the
    waiting requests a step skipped, and the prefills in flight (whose reservation
    each step asks the manager for)."""

    __slots__ = ("deferred", "holding", "inflight", "previous", "running", "waiting")

    def __init__(self, scheduler: Any) -> None:
        self.running = list(scheduler.running)
        self.waiting = list(scheduler.waiting)
        self.previous = set(scheduler.prev_step_scheduled_req_ids)
        holding = getattr(scheduler, "kv_holding_waiting", None)
        self.holding = list(holding) if holding is not None else []
        self.deferred = set(getattr(scheduler, "deferred_waiting", ()))
        self.inflight = set(getattr(scheduler, "_inflight_prefills", ()))


class UndoCutShort:
    """The undo of a cut-short schedule() call (a mixin of the kvcoord schedulers)."""

    kvcoord: Any
    kv_cache_manager: Any
    encoder_cache_manager: Any
    running: list[Any]
    waiting: Any
    kvcoord_undone: int
    prev_step_scheduled_req_ids: set[str]
    #: (the scheduler's own: see vllm_scheduler)
    _preempt: Any
    _preempted: Any
    _put_back: Any

    def _undo(self, before: Before, lost: set[str], held: list[Any]) -> None:
        """A schedule() call failed half-way: back to where it started, except that every
        running request it allocated for or that is lost is preempted (the manager may
        have given it blocks the worker will never hear of), and those it preempted
        stay preempted. Waiting requests it admitted are waiting again as they were
        (their blocks freed, and out of vLLM 0.33's prefills in flight), so they are
        scheduled as new; but one it admitted to an asynchronous KV load stays admitted
        as vLLM left it (waiting for the load, its blocks kept): the connector was told
        to load into its blocks, and nothing can take that back (a loss that cut the
        call short makes it a lost load, as any: see _lost_during_transfers). A waiting
        request whose blocks held computed tokens (a finished load the call promoted)
        starts over when they are freed (see :meth:`_start_over`).

        Every request the call allocated for is freed (or preempted) with the manager's
        ``undoing`` set: its free drops the cache entries the call's allocation made
        for blocks whose KV was never written (see the manager's ``free``)."""
        self.kvcoord_undone += 1
        self.kvcoord.undoing = True
        try:
            self._undo_call(before, lost, held)
        finally:
            self.kvcoord.undoing = False

    def _undo_call(self, before: Before, lost: set[str], held: list[Any]) -> None:
        """:meth:`_undo`'s work, the manager ``undoing``."""
        allocated, seen = self.kvcoord.allocated, self.kvcoord.seen
        now = time.monotonic()
        inflight = getattr(self, "_inflight_prefills", None)
        loading = RequestStatus.WAITING_FOR_REMOTE_KVS
        for r in (*before.holding, *before.waiting):
            fields = seen.get(r.request_id)
            if fields is None:
                continue  # not looked at by the call
            if r.status == loading and fields[0] != loading:
                continue  # admitted to an asynchronous load by the call: kept
            freed = r.request_id in allocated
            if freed:
                self.kv_cache_manager.free(r)
                self.encoder_cache_manager.free(r)
            r.status, r.num_computed_tokens, r.num_cached_tokens, r.num_external_computed_tokens = fields
            if inflight is not None and r not in before.inflight:
                inflight.discard(r)
            if freed and (r.num_computed_tokens or r.status == loading):
                self._start_over(r)
        keep, preempt, preempted = [], [], []
        for r in before.running:
            if r.status != RequestStatus.RUNNING:
                preempted.append(r)  # preempted by the call: freed already
            elif r.request_id in lost or r.request_id in allocated:
                preempt.append(r)
            else:
                keep.append(r)
        self.running = keep
        waiting = self.waiting
        waiting.remove_requests(list(waiting))
        holding = getattr(self, "kv_holding_waiting", None)
        if holding is not None:  # (vLLM 0.33)
            holding.remove_requests(list(holding))
            self.deferred_waiting.clear()  # type: ignore[attr-defined]
            self.deferred_waiting.update(before.deferred)  # type: ignore[attr-defined]
        # vLLM 0.33 queues a waiting request by whether it holds blocks (an admitted load)
        enqueue = getattr(self, "_enqueue_waiting_request", waiting.add_request)
        for r in (*before.holding, *before.waiting):
            enqueue(r)
        previous = self.prev_step_scheduled_req_ids
        previous.clear()
        previous.update(before.previous)
        for r in reversed(preempted):
            waiting.prepend_request(r)
            self._preempted(r.request_id)
        for r in reversed(preempt):
            self._preempt(r, now)
        self._put_back(held)

    def _start_over(self, request: Any) -> None:
        """A waiting request whose blocks the undo freed while its computed tokens lived
        in them: the tokens of a finished asynchronous load the call promoted (vLLM
        cached the loaded blocks, counted the loaded tokens as computed and forgot the
        connector's report), or any a waiting request holding blocks had. It starts over
        as after vLLM's preemption: nothing computed (external tokens included: its
        next lookup finds its prefix cache hit and asks the connector anew), status
        WAITING (PREEMPTED if it was preempted before), out of vLLM 0.33's prefills in
        flight and KV fetch stages; ``num_cached_tokens`` is kept, as vLLM's preemption
        keeps it. Putting it back as it was before the call instead (waiting for its
        load, the report re-armed, its blocks kept) would need the server's table to be
        as it was, which after an outage cannot be known (the allocation may have been
        applied): a recomputation, or a prefix cache hit on the blocks it had cached,
        is honest either way."""
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_external_computed_tokens = 0
        inflight = getattr(self, "_inflight_prefills", None)
        if inflight is not None:
            inflight.discard(request)
        set_stage = getattr(self, "_set_kv_fetch_stage", None)  # (vLLM 0.33, stats on)
        if set_stage is not None:
            set_stage(request, None)
