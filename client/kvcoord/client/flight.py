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
    costs a work item, a condition and a queue per Step)."""

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
    be sent, and a settle would wait for it forever)."""

    __slots__ = ("_queue", "_serve", "closed", "lock", "pool", "thread")

    def __init__(self, serve: Callable[[queue.SimpleQueue[Any]], None], pool: str) -> None:
        self._serve = serve
        self.pool = pool
        self.lock = threading.Lock()
        self.closed = False
        self._queue: queue.SimpleQueue[Any] | None = None
        self.thread: threading.Thread | None = None

    def check_open(self) -> None:
        """With ``lock`` held, before a hand-over."""
        if self.closed:
            raise FailedPreconditionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"predicted pool {self.pool!r}: the Step sender is closed",
            )

    def put(self, item: Any) -> None:
        """With ``lock`` held: hand ``item`` to the thread (started now if none runs)."""
        q = self._queue
        if q is None:
            q = queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(q,), name="kvcoord-sender", daemon=True)
            thread.start()
            self._queue, self.thread = q, thread
        q.put(item)

    def close(self, gate: Gate) -> None:
        """Stop the thread once what was handed over is done; later hand-overs refused."""
        with self.lock:
            self.closed = True
            q, thread = self._queue, self.thread
            self._queue = self.thread = None
            if q is not None:
                q.put(None)
        gate.open()
        if thread is not None:
            thread.join()
