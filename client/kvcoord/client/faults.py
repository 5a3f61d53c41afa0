"""A channel interceptor that loses, delays, duplicates and reorders answers (for tests).

Put it on a client (``KVCoordClient(..., interceptors=[FaultInjector(...)])``) to see
what a worker does when the network misbehaves *after* the server applied a call:

* drop: the call reaches the server and is applied, the answer is lost (UNAVAILABLE);
* delay: the answer arrives after the caller's deadline (DEADLINE_EXCEEDED);
* duplicate: the server receives the same request twice;
* reorder: an old request is delivered again, late, after newer calls.

Every fault is drawn from a seeded generator, so a run is repeatable; the counters
say what was injected.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Collection
from typing import Any

import grpc

__all__ = ["FaultInjector"]


class _InjectedError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def initial_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        # an outer interceptor's continuation returns this error as the call's outcome
        raise self


class FaultInjector(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Args:
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

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        if self.partitioned:
            raise _InjectedError(grpc.StatusCode.UNAVAILABLE, "injected: network partition")
        if not self.enabled or details.method.rsplit("/", 1)[-1] not in self.methods:
            return continuation(details, request)
        with self._lock:
            self.counts["calls"] += 1
            draw = self.rnd.random()
            late = self._held.pop(0) if self._held and self.rnd.random() < self.p[3] else None
        if late is not None:
            # An old copy arrives after newer calls; whatever it gets back goes nowhere.
            self.counts["reordered"] += 1
            _deliver(continuation, *late)
        drop, delay, duplicate, reorder = self.p
        if draw < drop:
            _deliver(continuation, details, request)
            self.counts["dropped"] += 1
            raise _InjectedError(grpc.StatusCode.UNAVAILABLE, "injected: connection lost before the answer")
        if draw < drop + delay:
            _deliver(continuation, details, request)
            self.counts["delayed"] += 1
            raise _InjectedError(grpc.StatusCode.DEADLINE_EXCEEDED, "injected: answer after the deadline")
        if draw < drop + delay + duplicate:
            _deliver(continuation, details, request)
            self.counts["duplicated"] += 1
            return continuation(details, request)
        if draw < drop + delay + duplicate + reorder:
            with self._lock:
                self._held.append((details, request))
        return continuation(details, request)


def _deliver(continuation: Callable[..., Any], details: Any, request: Any) -> None:
    """Send a request and wait until the server has answered (the answer is discarded)."""
    outcome = continuation(details, request)
    try:
        outcome.result()
    except grpc.RpcError:
        pass
