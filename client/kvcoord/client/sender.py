"""The one Step sender of every manager: it sends a session's Steps, inline or from one
background thread, dispatches their answers, classifies failures and recovers lost
requests. Both modes stamp, send and renew through :meth:`StepSender._send` and count
lost requests in :attr:`StepSender.lost_requests`.

The waiting mode (``RemoteKVCacheManager``) sends inline: calls nobody waits for are
queued (:meth:`~StepSender.defer`) and ride with the next call that needs an answer
(:meth:`~StepSender.send_items`). A failed Step is classified there: an ended session
loses every request; an unknown outcome loses the Step's requests (freed on the server,
best effort); a refused Step moves them back; a queued free that may not have happened
is sent again.

The predicted mode (``PredictingKVCacheManager``) gathers each scheduler step's calls
into one Step (:meth:`~StepSender.op`; allocations as the columns of one run), sends it
from the background thread when the step ends (:meth:`~StepSender.cut`; while one is
in flight, later steps' calls join the next, up to ``max_backlog`` steps or
``max_step_bytes``; under vLLM's scheduler the thread starts on it once the next
schedule() returns and the model runs: :meth:`~StepSender.release`), and compares the answer with the mirror's: every status, new
block id, the free count, the KV events (by digest) and the statistics. A failure
waits in :attr:`~StepSender.failure` for the facade's next call, which
:meth:`~StepSender.recover` turns into every request lost. The scheduler's thread only
appends plain values; the sender thread writes the columns and digests the events.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from kvcoord.engine import KVCacheEvent, PrefixCacheStats
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import free_op
from kvcoord.wire.columns import write_packed_decode

from .answers import PredictionMismatchError, check_answer, op_error
from .client import KVCoordClient
from .errors import (
    AbortedError,
    AnswerEvictedError,
    FencedError,
    KVCoordError,
    LeaseExpiredError,
    OutcomeUnknownError,
    PermissionDeniedError,
    RequestsLostError,
    RequestUnknownError,
    ResourceExhaustedError,
    SessionExpiredError,
    SyncMismatchError,
    UnavailableError,
)
from .flight import Flight, Gate, Inbox
from .gathering import StepGathering
from .items import ColumnRun, Gathered, Item, add_stats, no_answer, to_send_again, touched
from .session import SessionKeeper
from .tracking import RequestTracker

__all__ = ["PredictionMismatchError", "StepSender"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: errors after which a free is sent again with the next Step (the server may answer
#: it then); any other refusal would refuse it again
_TRANSIENT = (UnavailableError, AbortedError, ResourceExhaustedError, LeaseExpiredError)


class StepSender(StepGathering):
    """Sends one session's Steps, inline (the waiting mode) or from one background
    thread (the predicted mode), and recovers the requests a failure loses.

    Args:
        client: the session's client.
        pool: the pool's name.
        keeper: the session (its id and fence go with each Step; answers renew it).
        tracker: the positions of the session's requests (committed or moved back by
            answers, cleared when the session is lost).
        compare_events: predicted: the pool keeps KV events (their digest is compared).
        compare_stats: predicted: the pool keeps statistics (they are compared).
        max_backlog: predicted: scheduler steps whose calls may wait for the Step in flight.
    """

    def __init__(
        self,
        client: KVCoordClient,
        pool: str,
        keeper: SessionKeeper,
        tracker: RequestTracker,
        *,
        compare_events: bool = False,
        compare_stats: bool = False,
        max_backlog: int = 0,
    ) -> None:
        self.client = client
        self.pool = pool
        self.keeper = keeper
        self.tracker = tracker
        #: Steps sent, and the seconds callers waited for their answers
        self.steps_sent = 0
        self.waited_seconds = 0.0
        #: requests reported lost (RequestsLostError) since the sender was created
        self.lost_requests = 0
        # the waiting mode's state
        #: calls sent with the next Step (frees, cache_blocks, remove_skipped_blocks, ...)
        self.queue: list[Item[Any]] = []
        #: what the answers carried: the pool's usage, this session's events (and whether
        #: the last answer cut them: StepResponse.events_more), its statistics
        self.usage: float | None = None
        self.events: list[pb.KVEvent] = []
        self.events_more = False
        self.stats = pb.PrefixCacheStats()
        #: the session was lost and starting it again failed: the next Step tries first
        self.reattach = False
        # the predicted mode's state
        self.compare_events = compare_events
        self.compare_stats = compare_stats
        self.max_backlog = max(0, max_backlog)
        #: a Step gathering more than this many bytes is sent as soon as the one in
        #: flight is answered (well under the server's max_message_bytes, 16 MiB by default)
        self.max_step_bytes = 4 << 20
        self.pending = Gathered()
        #: the next Step's empty Gathered, made on the sender thread once it sent the last
        #: (read and cleared by :meth:`cut` only when no Step is in flight)
        self.spare: Gathered | None = None
        #: the run of allocations being gathered (the Step's next operation)
        self.run: ColumnRun | None = None
        #: the sender thread (started by the first cut), and the Step it works on
        self.inbox = Inbox(self._serve, pool)
        self.in_flight: Flight | None = None
        #: scheduler steps whose calls joined the Step being gathered
        self.backlog = 0
        #: when the sender thread may write and send the Step handed to it (see :meth:`release`)
        self.gate = Gate()
        #: why the mirror can no longer be trusted (set by the sender thread), until
        #: the facade reports it
        self.failure: KVCoordError | None = None
        #: requests lost by a failure not reported yet (starting again failed)
        self.unreported: list[str] = []
        #: answers whose events were not comparable (the server's event buffer wrapped)
        self.events_gaps = 0

    def _send(self, request: pb.StepRequest, answer_within_lease: bool = False) -> pb.StepResponse:
        """One Step of this session: its id and fence stamped, the lease renewed and the
        fence adopted from the answer. With ``answer_within_lease``, an answer the lease
        may not have covered is refused (:meth:`SessionKeeper.check_answer`)."""
        keeper = self.keeper
        request.pool = self.pool
        session_id = request.session_id = keeper.session_id
        request.fence.CopyFrom(keeper.fence)
        at = keeper.clock()
        resp = self.client.send_step(request)
        if answer_within_lease:
            keeper.check_answer(at, session_id)
        keeper.renewed(at, session_id)
        keeper.adopt(resp.fence)
        return resp

    # -- the waiting mode: inline ---------------------------------------------------------
    def defer(self, item: Item[Any] | None) -> None:
        """Send ``item`` with the next Step (its Pending, read earlier, sends it)."""
        if item is not None:
            item.pending.resolver = self.flush
            self.queue.append(item)

    def flush(self) -> None:
        """Send every queued call now."""
        if self.queue:
            self.send_items([])

    def now(self, item: Item[T]) -> T:
        """Send ``item`` (with the queued calls) and return its answer."""
        self.send_items([item])
        return item.pending.result()

    def send_items(self, items: list[Item[Any]], force: bool = False) -> None:
        """One Step with the queued calls, then ``items``; every Pending gets its answer.
        Without anything to send, nothing is sent unless ``force``.

        Raises:
            the error of a queued call nobody waited for (after every Pending is set).
        """
        items = self.queue + items
        self.queue = []
        if not items and not force:
            return
        keeper = self.keeper
        try:
            if self.reattach:  # the session was lost and re-attaching failed last time
                keeper.start_again()
                self.reattach = False
                # releases queued meanwhile name the lost session's blocks: their
                # retentions ended with it (nothing was taken since: no session)
                kept = []
                for i in items:
                    if i.op.WhichOneof("op") == "release_retained_blocks":
                        i.pending.set_result(None)
                    else:
                        kept.append(i)
                items = kept
                if not items and not force:
                    return
            keeper.vouch()
            request = pb.StepRequest(ops=[item.op for item in items], include_state=True)
            self.steps_sent += 1
            waited = time.perf_counter()
            try:
                resp = self._send(request, answer_within_lease=True)
            finally:
                self.waited_seconds += time.perf_counter() - waited
        except KVCoordError as err:
            failure = self._failed(items, err)
            for i in items:
                i.pending.set_error(failure)
            if not items or any(i.deferred for i in items):
                # Queued calls have no caller waiting to see this: the caller that sent
                # them (take_events, usage, flush, close, any other call) must.
                raise failure from None
            return
        self._absorb(resp)
        self._dispatch(items, resp)

    def _failed(self, items: list[Item[Any]], err: KVCoordError) -> KVCoordError:
        """What a Step that failed as a whole costs: the error its calls raise."""
        if isinstance(err, (SessionExpiredError, FencedError, LeaseExpiredError)):
            return self.session_lost(err)  # its end frees everything (retained blocks too)
        unknown = isinstance(err, (OutcomeUnknownError, AnswerEvictedError))
        releases = [i.op for i in items if i.op.WhichOneof("op") == "release_retained_blocks"]
        if unknown and releases:
            # Whether its release of copy-on-write blocks happened is unknown: sent again
            # it could release a pair the Step made since, not sent the blocks stay
            # retained. The session's end releases them either way.
            return self.session_lost(err)
        if unknown or any(i.deferred and i.touched for i in items):
            # Applied or not, unknown; or not applied while queued calls in it
            # (cache_blocks, remove_skipped_blocks) were already taken as done: none of
            # its requests can be trusted.
            failure: KVCoordError = self.forget(touched(items), err)
        else:
            self.tracker.rollback(touched(items))
            failure = err
        self._send_again(items)  # its queued frees and drops may not have happened
        # Its releases did not happen (the Step was not applied): the next Step sends
        # them first (the blocks are still retained, nothing was made since).
        self.queue[:0] = [Item(o, no_answer, deferred=True) for o in releases]
        return failure

    def _dispatch(self, items: list[Item[Any]], resp: pb.StepResponse) -> None:
        """Each call's answer to its Pending (positions committed), or its error.

        Raises:
            the first error of a queued call nobody waited for.
        """
        failed: KVCoordError | None = None
        again: list[Item[Any]] = []  # frees and drops to send again
        for item, result in zip(items, resp.results, strict=True):
            if result.status_code == 0:
                if not item.commits_itself:
                    self.tracker.commit(item.touched, item.marks)
                item.pending.set_result(item.decode(result))
                continue
            op_err = op_error(result)
            if isinstance(op_err, (SyncMismatchError, RequestUnknownError)) and item.touched:
                # The server holds another state than this client believed: the request
                # cannot be trusted any more.
                op_err = self.forget(item.touched, op_err)
            elif (kind := item.op.WhichOneof("op")) == "free" or (
                item.deferred and kind == "drop_uncomputed"
            ):
                # Not applied: a free goes again now, a batch's too (its request is forgotten, its
                # blocks held by nobody known); so does an undone step's drop a failure kept out
                if kind == "free" or isinstance(op_err, AbortedError):
                    again.append(item)
            item.pending.set_error(op_err)
            if item.deferred and failed is None:
                failed = op_err
        self._send_again(again)
        if any(r.status_code for r in resp.results):
            self.tracker.rollback(touched(items))
        if failed is not None:
            raise failed

    def _absorb(self, resp: pb.StepResponse) -> None:
        """What every answer carries: usage, events, statistics."""
        self.usage = resp.usage
        if resp.events:
            self.events.extend(resp.events)
        self.events_more = resp.events_more
        if resp.HasField("prefix_cache_stats"):
            add_stats(self.stats, resp.prefix_cache_stats)

    # -- the waiting mode: lost requests --------------------------------------------------
    def session_lost(self, err: KVCoordError) -> RequestsLostError:
        """Every tracked request is gone with the session: forget them and re-attach."""
        lost = self.tracker.clear()
        self.lost_requests += len(lost)
        try:
            self.keeper.start_again()
        except KVCoordError:  # e.g. unreachable, or the server's grace period: next call
            self.reattach = True
        return RequestsLostError(lost, err)

    def _send_again(self, items: list[Item[Any]]) -> None:
        """Frees and drops not applied, or maybe not (:func:`to_send_again`): frees now,
        drops first in the next Step (kept, their entries would be hits on unwritten KV)."""
        frees, drops = to_send_again(items)
        for free in frees:
            self.free_now(free)
        self.queue[:0] = drops

    def free_now(self, free: pb.FreeOp) -> None:
        """Free a request on the server now, ``if_held`` (in a Step when ``free`` says what
        the Free RPC cannot: ``uncomputed_from``, ``all_groups_reversed``); queued for the
        next Step when the server cannot be reached. An unknown request, or another
        session's, is no error; any other refusal is logged and the free dropped."""
        keeper, request_id = self.keeper, free.request_id
        free.if_held = True
        op = pb.Operation(free=free)
        try:
            if not free.HasField("uncomputed_from") and not free.all_groups_reversed:
                self.client.free(self.pool, [request_id], session_id=keeper.session_id, fence=keeper.fence)
            elif (result := self._send(pb.StepRequest(ops=[op])).results[0]).status_code:
                raise op_error(result)
        except (RequestUnknownError, SessionExpiredError, FencedError, PermissionDeniedError):
            pass
        except _TRANSIENT:
            self.queue.append(Item(op, no_answer, deferred=True))
        except KVCoordError as err:
            logger.error(
                "session %s could not free request %r, which may stay held until the session ends: %s",
                keeper.session_id, request_id, err,
            )  # fmt: skip

    def forget(self, request_ids: Sequence[str], err: KVCoordError) -> RequestsLostError:
        """These requests' server state is unknown: free them there (best effort) and
        here, dropping the cache entries past the computed count each last sent (a Step
        that may have been applied cached blocks nobody computes: the scheduler recomputes)."""
        computed = {rid: self.tracker.sent_computed(rid) for rid in request_ids}
        lost = self.tracker.forget(request_ids, lost=True)
        for rid in lost:
            self.free_now(free_op(rid, uncomputed_from=computed[rid]))
        self.lost_requests += len(lost)
        return RequestsLostError(lost, err)

    # -- sending in the background ---------------------------------------------------------
    def cut(
        self, state: Callable[[], tuple[int, list[KVCacheEvent], PrefixCacheStats]], wait: bool = False
    ) -> bool:
        """End a scheduler step: send its calls unless a Step is in flight and the
        backlog allows them to wait. ``state`` gives what the answer must say (the
        mirror's free count, events and statistics), read only when the Step is sent.
        Returns whether a Step is to be sent and was (False: nothing gathered, or it
        waits for the next cut)."""
        self.close_run()
        if not self.pending.request.ops:
            return False
        in_flight = self.in_flight
        if in_flight is not None:
            if (
                not wait
                and not in_flight.done()
                and self.backlog < self.max_backlog
                and self.pending.size < self.max_step_bytes
            ):
                self.backlog += 1
                return False
            self.settle()
        if self.failure is not None:
            return False  # reported (and everything gathered dropped) by the facade first
        inbox = self.inbox
        with inbox.lock:  # (a close() on another thread waits for the hand-over; see Inbox)
            inbox.check_open()
            try:
                inbox.handing = True  # (a signal handler's close from here on: stops after it)
                try:
                    sent = self.pending
                    spare, self.spare = self.spare, None
                    self.pending = spare if spare is not None else Gathered()
                    sent.num_free_blocks, sent.events, sent.stats = state()
                    flight = Flight()
                    self.gate.shut()  # (the thread is idle: nothing in flight)
                    inbox.put((sent, flight))
                except BaseException as err:
                    # Interrupted (a signal's KeyboardInterrupt or close, a failing state()): the
                    # mirror applied calls no answer will confirm, nothing it predicts can be
                    # trusted; no flight is kept to wait on (a Step put all the same: recover).
                    self.failure = self.failure or KVCoordError(
                        grpc.StatusCode.CANCELLED, f"a Step was interrupted before it was sent ({err!r})"
                    )
                    raise
                self.in_flight = flight
                self.backlog = 0
                self.steps_sent += 1
                return True
            finally:
                inbox.handed(self.gate)

    def release(self) -> None:
        """The model runs now (vLLM's schedule() returned): the Step cut last is sent
        now, and every Step cut from now on waits for the next release (see :class:`Gate`)."""
        self.gate.open(for_good=True)

    def settle(self) -> None:
        """Wait for the Step in flight (its failure, if any, is in :attr:`failure`)."""
        in_flight = self.in_flight
        # (answered already, as at most cuts under vLLM: the Step went while the model
        # ran, the sender thread is past the gate and the next hand-over shuts it)
        if in_flight is not None and not in_flight.done():
            self.gate.open()  # (waited for now: sent at once)
            t0 = time.perf_counter()
            in_flight.result()  # (interrupted by a signal: the next settle waits again)
            self.waited_seconds += time.perf_counter() - t0
        self.in_flight = None

    def close(self) -> None:
        """Let the Steps handed over finish and stop the sender thread; any thread may
        call it (a hand-over under way finishes first; inside its own, from a signal
        handler, it returns at once: see :class:`Inbox`); a cut after it is refused."""
        self.inbox.close(self.gate)

    def _serve(self, inbox: queue.SimpleQueue[tuple[Gathered | None, Flight] | None]) -> None:
        """The sender thread: each Step handed over by :meth:`cut`, in order, until
        :meth:`close`."""
        gate = self.gate
        while (item := inbox.get()) is not None:
            sent, flight = item
            item = None
            try:
                if sent is not None:  # (None: a barrier, Inbox.drain)
                    gate.wait()
                    self._step(sent)
                    if self.spare is None:
                        self.spare = Gathered()  # (here, not on the scheduler's thread)
            finally:
                # the Step and what it holds (its frees' records: Gathered.dropped) are freed
                # now, while the model runs, not when the scheduler's next cut wakes this thread
                del sent
                flight.finish()

    def recover(self) -> RequestsLostError:
        """After a background Step failed (:attr:`failure` set): every request of the
        session is lost (the mirror can no longer be trusted), what was gathered is
        dropped, and the session starts again. Returns the error to raise.

        Raises:
            KVCoordError: the server cannot be reached to start again (the next call
                tries again; the requests lost so far are reported then).
        """
        failure = self.failure
        assert failure is not None, "nothing failed"
        self.settle()
        self.inbox.drain(self.gate)  # (an interrupted hand-over's Step goes with the old session)
        gone = self.tracker.clear()
        if gone:
            logger.warning("predicted pool %r: %s; %d request(s) lost", self.pool, failure, len(gone))
        self.unreported.extend(gone)
        self.discard()
        self.keeper.start_again()
        lost, self.unreported, self.failure = self.unreported, [], None
        self.lost_requests += len(lost)
        return RequestsLostError(lost, failure)

    def _step(self, sent: Gathered) -> None:
        """On the sender thread: one Step, its answer compared with the mirror's; a
        failure is kept for the caller's next call to report."""
        try:
            self._checked_step(sent)
        except KVCoordError as err:
            self.failure = self.failure or err
        except BaseException as err:  # noqa: BLE001 - anything else too (the thread goes on)
            self.failure = self.failure or KVCoordError(grpc.StatusCode.INTERNAL, repr(err))

    def _checked_step(self, sent: Gathered) -> None:
        for _, write in sent.writes:
            write()
        decode = "decode_op" in self.keeper.capabilities  # the server applies DecodeOp
        for op, run in sent.runs:
            if decode:
                op.decode.must_succeed = True
                write_packed_decode(op.decode, run)
            else:
                run.write(op.allocate_run)
        resp = self._send(sent.request)
        check_answer(resp, sent, self.compare_events, self.compare_stats, self._events_gap)

    def _events_gap(self) -> None:
        """The server's event buffer wrapped before a Step's events were taken (an
        eviction larger than its event_buffer): its digest covers only the events it
        still kept, so it cannot be compared with the mirror's whole list. That is no
        disagreement: the block ids, free count and statistics are still compared, and
        the engine publishes the mirror's events, which are complete."""
        self.events_gaps += 1
        logger.info(
            "predicted pool %r: the server's event buffer wrapped during a Step; its events "
            "were not compared (everything else was)", self.pool,
        )  # fmt: skip
