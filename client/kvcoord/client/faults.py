"""A channel interceptor that loses, delays, duplicates and reorders answers (for tests).

Put it on a client (``KVCoordClient(..., interceptors=[FaultInjector(...)])``) to see
what a worker does when the network misbehaves *after* the server applied a call:

* drop: the call reaches the server and is applied, the answer is lost (UNAVAILABLE);
* delay: the answer arrives after the caller's deadline (DEADLINE_EXCEEDED);
* duplicate: the server receives the same request twice;
* reorder: an old request is delivered again, late, after newer calls.

On a StepStream (each message one Step) the same faults are drawn per message: a
dropped answer breaks the stream (UNAVAILABLE) after the server answered; a delayed
one cancels the stream and fails DEADLINE_EXCEEDED (with ``hold_delayed``: it is never
delivered, the stream hangs until the client cancels it by its per-Step timeout); a
duplicate or a late old copy is sent on the stream too, its answer read
and discarded; a partition fails the stream before the message is sent.

Every fault is drawn from a seeded generator, so a run is repeatable; the counters
say what was injected.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Collection
from typing import Any

import grpc

from .errors import LocalRpcError

__all__ = ["DELIVERED_FIRST", "FaultInjector", "FaultRules"]

#: the faults of a unary call that deliver it (and wait for its answer) before its caller
#: hears anything (:meth:`FaultRules._delivered`)
DELIVERED_FIRST = ("drop", "delay", "duplicate")


class FaultRules:
    """What both fault injectors share (this module's, for the blocking client, and
    :class:`kvcoord.client.faults_aio.AsyncFaultInjector`): the seeded draw of each
    call's fault, the counters, the partition switch and the drop hook.

    Args:
        seed: the generator's seed.
        drop, delay, duplicate, reorder: probability of each fault per call.
        methods: RPC names the faults apply to (others pass untouched).
    """

    def __init__(
        self,
        seed: int,
        *,
        drop: float = 0.0,
        delay: float = 0.0,
        duplicate: float = 0.0,
        reorder: float = 0.0,
        methods: Collection[str] = ("Step", "Allocate", "Free"),
    ) -> None:
        self.rnd = random.Random(seed)
        self.p = (drop, delay, duplicate, reorder)
        self.methods = set(methods)
        self.counts = {"calls": 0, "dropped": 0, "delayed": 0, "duplicated": 0, "reordered": 0}
        self._held: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()
        self.enabled = True
        #: while True, every call (of any method) fails without reaching the server
        self.partitioned = False
        #: called once a dropped call (or stream message) was answered by the server,
        #: before its caller is told the answer was lost (a test may kill the server there)
        self.on_drop: Callable[[], None] | None = None

    def dropped(self) -> None:
        """Count a dropped answer, then call :attr:`on_drop`."""
        self.counts["dropped"] += 1
        if self.on_drop is not None:
            self.on_drop()

    def faulted(self, method: str | bytes) -> bool:
        """Whether a call of ``method`` (a full gRPC method path) draws faults."""
        name = method.decode() if isinstance(method, bytes) else method
        return self.enabled and name.rsplit("/", 1)[-1] in self.methods

    def _draw(self, item: Any, held: list[Any]) -> tuple[str, Any]:
        """One call's (or stream message's) fault: "drop", "delay", "duplicate", "hold"
        (``item`` kept in ``held``, to be delivered late) or "none"; and the late old
        copy to deliver before it, if any."""
        with self._lock:
            self.counts["calls"] += 1
            draw = self.rnd.random()
            late = held.pop(0) if held and self.rnd.random() < self.p[3] else None
            if late is not None:
                self.counts["reordered"] += 1
            fault = "none"
            for name, p in zip(("drop", "delay", "duplicate", "hold"), self.p, strict=True):
                if draw < p:
                    fault = name
                    break
                draw -= p
            if fault == "hold":
                held.append(item)
        return fault, late

    def _unary_draw(self, details: Any, request: Any, held: Callable[[], list[Any]]) -> tuple[str, Any]:
        """A unary call's fault and the late old copy to deliver before it (``held``:
        the copies held back that it may be); "pass" for a call left untouched.
        Raises the partition's failure while partitioned."""
        if self.partitioned:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: network partition")
        if not self.faulted(details.method):
            return "pass", None
        return self._draw((details, request), held())

    def _delivered(self, fault: str) -> None:
        """A faulted call was delivered and answered once (its ``fault`` "drop", "delay"
        or "duplicate"): count it, and raise what its caller is told instead of the
        answer (a duplicate is then delivered again, and answered)."""
        if fault == "drop":
            self.dropped()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: connection lost before the answer")
        if fault == "delay":
            self.counts["delayed"] += 1
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "injected: answer after the deadline")
        self.counts["duplicated"] += 1


class FaultInjector(FaultRules, grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    """The blocking client's (a ``grpc`` channel interceptor): :class:`FaultRules`'
    arguments, and

    hold_delayed: a delayed StepStream answer is held until the client cancels the
        stream (its per-Step timeout), instead of failing at once.
    """

    def __init__(self, seed: int, *, hold_delayed: bool = False, **faults: Any) -> None:
        super().__init__(seed, **faults)
        self.hold_delayed = hold_delayed
        self._held_messages: list[Any] = []  # (StepStream's)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        fault, late = self._unary_draw(details, request, lambda: self._held)
        if late is not None:
            # An old copy arrives after newer calls; whatever it gets back goes nowhere.
            _deliver(continuation, *late)
        if fault in DELIVERED_FIRST:
            _deliver(continuation, details, request)
            self._delivered(fault)
        return continuation(details, request)

    def draw_message(self, request: Any) -> tuple[str, Any]:
        """A StepStream message's fault and late old copy (:meth:`_draw`; a message is a
        Step: faulted when "Step" is in ``methods``); "cut" while partitioned."""
        if self.partitioned:
            return "cut", None
        if not self.enabled or "Step" not in self.methods:
            return "none", None
        return self._draw(request, self._held_messages)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        if not details.method.endswith("/StepStream"):
            return continuation(details, requests)
        return _FaultyStream(self, continuation, details, requests)


class _FaultyStream:
    """A StepStream call with the injector's faults drawn per message (one in flight)."""

    def __init__(
        self, faults: FaultInjector, continuation: Callable[..., Any], details: Any, requests: Any
    ) -> None:
        self.faults = faults
        self.plans: queue.SimpleQueue[tuple[str, bool]] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.call = continuation(details, self._sent(iter(requests)))

    def _sent(self, requests: Any) -> Any:
        """What reaches the server (read on gRPC's thread): each message, with its late
        old copy before it and its duplicate after it."""
        for request in requests:
            fault, late = self.faults.draw_message(request)
            if fault == "cut":
                self.plans.put((fault, False))
                return
            self.plans.put((fault, late is not None))  # (before sending: a late copy's refusal ends the call)
            if late is not None:
                yield late
            yield request
            if fault == "duplicate":
                yield request

    def __iter__(self) -> _FaultyStream:
        return self

    def __next__(self) -> Any:
        while True:  # until the message was sent, or the call ended (then never read)
            try:
                fault, late = self.plans.get(timeout=0.05)
                break
            except queue.Empty:
                if self.cancelled.is_set() or not self.call.is_active():
                    return next(self.call)  # raises how the call ended
        counts = self.faults.counts
        if fault == "cut":
            self.call.cancel()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: network partition")
        if late:
            try:
                next(self.call)  # the old copy's answer goes nowhere
            except grpc.RpcError:  # its refusal ended the stream: this message was never read
                raise LocalRpcError(
                    grpc.StatusCode.UNAVAILABLE, "injected: a late old copy's refusal ended the stream"
                ) from None
        answer = next(self.call)
        if fault == "duplicate":
            counts["duplicated"] += 1
            return next(self.call)  # the second copy's answer (the first one's, kept)
        if fault == "drop":
            self.faults.dropped()
            self.call.cancel()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: stream broken before the answer")
        if fault == "delay":
            counts["delayed"] += 1
            if not self.faults.hold_delayed:
                self.call.cancel()
                raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "injected: answer after the deadline")
            self.cancelled.wait(60)  # held until the client gives up on it (bounded)
            raise LocalRpcError(grpc.StatusCode.CANCELLED, "injected: answer held until cancelled")
        return answer

    def cancel(self) -> bool:
        self.cancelled.set()
        return bool(self.call.cancel())


def _deliver(continuation: Callable[..., Any], details: Any, request: Any) -> None:
    """Send a request and wait until the server has answered (the answer is discarded)."""
    outcome = continuation(details, request)
    try:
        outcome.result()
    except grpc.RpcError:
        pass
