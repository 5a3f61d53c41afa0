"""How the predicted mode's sender thread and the scheduler's thread meet over one Step:
:class:`Flight`, the Step handed over until it is answered, and :class:`Gate`, when the
thread may start on it (:class:`~.sender.StepSender`)."""

from __future__ import annotations

import threading

__all__ = ["Flight", "Gate"]


class Gate:
    """When the sender thread may write and send the Step handed to it: at once, until
    vLLM's scheduler first says the model runs (:meth:`open` ``for_good``: each
    schedule() returned, ``StepSender.release``); from then on a Step cut at a step's
    end (:meth:`shut`) waits for the next opening, so its writing, sending and
    checking take the GIL while the model runs, not during the scheduler's next
    calls. It waits at most ``max_seconds`` (an engine gone idle schedules nothing),
    and a caller waiting for the Step opens it (``StepSender.settle``, ``close``)."""

    __slots__ = ("_open", "max_seconds", "used")

    def __init__(self, max_seconds: float = 0.05) -> None:
        self._open = threading.Event()
        self.max_seconds = max_seconds
        #: whether anyone opens it (else it never holds a Step)
        self.used = False

    def open(self, for_good: bool = False) -> None:
        if for_good:
            self.used = True
        event = self._open
        if not event.is_set():  # (only the scheduler's thread opens and shuts it: no race)
            event.set()

    def shut(self) -> None:
        """A Step is handed over now (the sender thread is idle)."""
        if self.used and self._open.is_set():
            self._open.clear()

    def wait(self) -> None:
        """On the sender thread: until the gate opens (at most ``max_seconds``)."""
        if self.used:
            self._open.wait(self.max_seconds)


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
