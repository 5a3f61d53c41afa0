"""How the predicted mode's sender thread and the scheduler's thread meet over one Step:
:class:`Flight`, the Step handed over until it is answered, :class:`Gate`, when the
thread may start on it, and :class:`Inbox`, the thread and what is handed to it
(:class:`~.sender.StepSender`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import grpc

from .errors import FailedPreconditionError

__all__ = ["Flight", "Gate", "Inbox"]


class Gate:
    """When the sender thread may write and send the Step handed to it: at once, until
    vLLM's scheduler first says the model runs (:meth:`open` ``for_good``: each
    schedule() returned, ``StepSender.release``); from then on a Step cut at a step's
    end (:meth:`shut`) waits for the next opening, so its writing, sending and
    checking take the GIL while the model runs, not during the scheduler's next
    calls. It waits at most ``max_seconds`` (an engine gone idle schedules nothing),
    and a caller waiting for the Step opens it (``StepSender.settle``, ``close``)."""

    __slots__ = ("_shut", "max_seconds", "used")

    def __init__(self, max_seconds: float = 0.05) -> None:
        #: held while the gate is shut: a lock's C calls cost a few hundred instructions
        #: where an ``Event``'s ``set`` (its condition's Python ``notify_all``) costs
        #: thousands, and the scheduler's thread opens and shuts the gate every step
        self._shut = threading.Lock()
        self.max_seconds = max_seconds
        #: whether anyone opens it (else it never holds a Step)
        self.used = False

    def open(self, for_good: bool = False) -> None:
        if for_good:
            self.used = True
        shut = self._shut
        if shut.locked():
            try:
                shut.release()
            except RuntimeError:
                pass  # opened meanwhile by another thread (or the waiter passed): open either way

    def shut(self) -> None:
        """A Step is handed over now (the sender thread is idle)."""
        if self.used:
            self._shut.acquire(False)  # (shut already: stays shut)

    def wait(self) -> None:
        """On the sender thread: until the gate opens (at most ``max_seconds``); it stays
        open (the waiter takes the lock and gives it back at once)."""
        if self.used:
            shut = self._shut
            if shut.acquire(True, self.max_seconds):
                try:
                    shut.release()
                except RuntimeError:
                    pass  # an opener released it in between: open either way


class Flight:
    """A Step handed to the sender thread, :meth:`done` and :meth:`result` as a
    ``Future``'s: one lock, held until the Step is answered (an executor's future
    costs a work item, a condition and a queue per Step). Also a barrier
    (:meth:`Inbox.drain`) and the thread's end (:attr:`Inbox.done`)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def done(self) -> bool:
        return not self._lock.locked()

    def result(self) -> None:
        """Wait until the Step is answered (its failure, if any, is the sender's)."""
        with self._lock:
            pass

    def finish(self) -> None:
        """On the sender thread: the Step is answered (or failed)."""
        self._lock.release()


class Inbox:
    """The sender thread (started by the first :meth:`put`) and its queue. ``lock`` is
    held by the scheduler's thread while it hands a Step over and by :meth:`close`, so
    a close on any thread never falls inside a hand-over: a Step handed over is sent
    before the thread stops, and none is put after the thread stopped (it would never
    be sent, and a settle would wait for it forever).

    A signal handler runs on the main thread, between two of its bytecodes: inside the
    main thread's own hand-over, a handler's :meth:`close` could never get a plain lock
    that frame holds. ``lock`` is re-entrant, and ``handing`` tells that frame is under
    way: such a close marks the inbox closed and returns, and the hand-over, when it
    ends (:meth:`handed`), stops the thread after its Step. A hand-over begun from a
    handler inside another is refused (:meth:`check_open`)."""

    __slots__ = ("_queue", "_serve", "closed", "done", "handing", "lock", "pool", "stopped", "thread")

    def __init__(self, serve: Callable[[queue.SimpleQueue[Any]], None], pool: str) -> None:
        self._serve = serve
        self.pool = pool
        self.lock = threading.RLock()
        self.closed = False
        #: a hand-over holds ``lock`` and is under way (set inside the lock only)
        self.handing = False
        #: the thread was told to stop (after :attr:`closed`: a hand-over it let finish
        #: puts its Step before)
        self.stopped = False
        self._queue: queue.SimpleQueue[Any] | None = None
        #: the thread and its end (finished when it returns), until a close saw it end
        #: (a close interrupted while it waits leaves them for the next close)
        self.thread: threading.Thread | None = None
        self.done: Flight | None = None

    def check_open(self) -> None:
        """With ``lock`` held, before a hand-over (which then sets ``handing``)."""
        if self.closed:
            raise FailedPreconditionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"predicted pool {self.pool!r}: the Step sender is closed",
            )
        if self.handing:
            raise FailedPreconditionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"predicted pool {self.pool!r}: a Step is being handed over on this thread "
                "(a signal handler called in during it)",
            )

    def put(self, item: Any) -> None:
        """With ``lock`` held and ``handing`` set: hand ``item`` to the thread (started
        now if none runs); refused once the thread was told to stop (a signal handler's
        close between :meth:`check_open` and ``handing``: nothing would send it)."""
        if self.stopped:
            self.check_open()
        q = self._queue
        if q is None:
            q, done = queue.SimpleQueue(), Flight()
            thread = threading.Thread(target=self._run, args=(q, done), name="kvcoord-sender", daemon=True)
            thread.start()
            self._queue, self.thread, self.done = q, thread, done
        q.put(item)

    def _run(self, q: queue.SimpleQueue[Any], done: Flight) -> None:
        """The thread: ``serve`` until its stop mark; ``done`` finished as it returns."""
        try:
            self._serve(q)
        finally:
            done.finish()

    def handed(self, gate: Gate) -> None:
        """With ``lock`` held, when a hand-over ends (put or not): a close called inside
        it (a signal handler's) stops the thread now, after what was put."""
        self.handing = False
        if self.closed:
            self._stop(gate)

    def _stop(self, gate: Gate) -> None:
        """With ``lock`` held: the thread's stop mark, after what was handed over (put
        before the queue is let go: a handler's close between the two puts a second,
        never none)."""
        self.stopped = True
        q = self._queue
        if q is not None:
            q.put(None)
            self._queue = None
        gate.open()

    def drain(self, gate: Gate) -> None:
        """Wait until the thread has done everything put so far: a barrier (no Step) goes
        after it. A hand-over interrupted by a signal may have put its Step though its
        cut raised and no flight was kept: a session started again before that Step
        went would be stamped on it."""
        barrier = Flight()
        with self.lock:
            q = self._queue
            if q is not None:
                q.put((None, barrier))
        if q is None:  # (no thread runs, or it was told to stop)
            barrier.finish()
        gate.open()
        barrier.result()

    def close(self, gate: Gate) -> None:
        """Stop the thread once what was handed over is done; later hand-overs refused.
        Inside this thread's own hand-over (a signal handler's call) it returns at once
        and the hand-over stops the thread (:meth:`handed`); interrupted while it waits,
        the next close waits again."""
        with self.lock:
            self.closed = True
            if self.handing:  # this thread's hand-over, below this call: it cannot be waited for
                return
            self._stop(gate)
            done = self.done
        if done is not None:
            # (not Thread.join: CPython 3.11's join, interrupted by a signal, marks a
            # thread that still runs as stopped, and every later join returns at once)
            done.result()
            if self.done is done:
                self.thread = self.done = None
