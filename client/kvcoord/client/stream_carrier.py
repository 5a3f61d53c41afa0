"""Steps carried on one StepStream call per replica (the blocking client's carrier).

A server whose AttachResponse.capabilities lists "step_stream" takes Steps as the
messages of one long-lived StepStream call, each answered exactly as the unary Step
(same checks, same answer, same errors), at about half the server's gRPC cost per Step.
:meth:`~kvcoord.client.client.KVCoordClient.send_step` sends a Step on the stream of
the replica it routes to; everything else about the call is the unary path's: the
same retry loop (retry.py), owner routing (owners.py) and typed errors (errors.py).

Rules of the carrier:

* One Step in flight per stream; a second thread sending meanwhile uses a unary Step
  (no waiting behind another caller's Step).
* Each Step has the client's per-attempt ``timeout``: a Step not answered in time
  cancels the stream (a watchdog thread checks the Step in flight a few times per
  timeout; nothing is done per Step but noting its due time) and fails with
  DEADLINE_EXCEEDED, an unknown outcome, so the retry loop resends it under its
  idempotency key: applied at most once.
* Any failure (the Step's own error status, which ends the stream on the server, a
  broken connection, a timeout) retires the stream; the next Step opens a new one.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from .errors import LocalRpcError

__all__ = ["STEP_STREAM", "StepCarrier"]

#: the AttachResponse.capabilities entry of a server that serves StepStream
STEP_STREAM = "step_stream"

#: ends a stream's request iterator
_END = object()


class _Stream:
    """One open StepStream call: requests fed through a queue (gRPC reads them on its
    own thread), answers read in order on the caller's thread."""

    def __init__(self, stub: Any, metadata: Any) -> None:
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call = stub.StepStream(iter(self.requests.get, _END), metadata=metadata)
        #: (due time, Step number) of the Step in flight, or None
        self.pending: tuple[float, int] | None = None
        self.sent = 0
        #: the Step number the watchdog cancelled the stream for
        self.expired = -1
        self.done = False

    def expire(self, number: int) -> None:
        """Cancel the stream for Step ``number`` (not answered in time)."""
        self.expired = number
        self.close()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.requests.put(_END)
            self.call.cancel()


class StepCarrier:
    """The Step streams of one client, one per replica address, opened on first use.

    Args:
        stub_of: the stub of an address (the client's channel to it, interceptors on).
        metadata_of: the call metadata (authorization, the replica named there) a stream
            to an address is opened with.
        timeout: the most seconds a Step waits for its answer on a stream.
    """

    def __init__(
        self, stub_of: Callable[[str], Any], metadata_of: Callable[[str], Any], timeout: float
    ) -> None:
        self._stub_of = stub_of
        self._metadata_of = metadata_of
        self.timeout = timeout
        self._streams: dict[str, _Stream] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        #: how many streams were opened (tests and benchmarks read it)
        self.opened = 0

    def try_send(self, address: str, request: pb.StepRequest) -> pb.StepResponse | None:
        """The answer to ``request`` sent on ``address``'s stream, or None when another
        thread's Step is on it (send it unary). Raises grpc.RpcError when the Step
        failed (the stream is then retired)."""
        lock = self._locks.get(address)
        if lock is None:
            with self._guard:
                lock = self._locks.setdefault(address, threading.Lock())
        if not lock.acquire(blocking=False):
            return None
        try:
            return self._send(address, request)
        finally:
            lock.release()

    def _send(self, address: str, request: pb.StepRequest) -> pb.StepResponse:
        stream = self._streams.get(address)
        if stream is None or stream.done:
            stream = self._open(address)
        stream.sent += 1
        number = stream.sent
        stream.pending = (time.monotonic() + self.timeout, number)
        stream.requests.put(request)
        try:
            answer: pb.StepResponse = next(stream.call)
        except StopIteration:
            stream.close()
            raise LocalRpcError(
                grpc.StatusCode.UNAVAILABLE, "the Step stream ended without an answer"
            ) from None
        except grpc.RpcError:
            stream.close()
            if stream.expired == number:
                raise LocalRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the Step was not answered within {self.timeout}s; its stream was cancelled",
                ) from None
            raise
        finally:
            stream.pending = None
        return answer

    def _open(self, address: str) -> _Stream:
        stream = _Stream(self._stub_of(address), self._metadata_of(address))
        self._streams[address] = stream
        self.opened += 1
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=_watch, args=(weakref.ref(self), self._stop), name="kvcoord-step-stream", daemon=True
            )
            self._watchdog.start()
        return stream

    def check(self, now: float) -> None:
        """Cancel every stream whose Step in flight is overdue (the watchdog's round)."""
        for stream in list(self._streams.values()):
            pending = stream.pending
            if pending is not None and now > pending[0] and not stream.done:
                stream.expire(pending[1])

    def close(self) -> None:
        """Close every stream (a Step in flight fails) and stop the watchdog."""
        self._stop.set()
        for stream in list(self._streams.values()):
            stream.close()
        self._streams.clear()


def _watch(carrier: weakref.ref[StepCarrier], stop: threading.Event) -> None:
    """The watchdog: a few rounds per timeout (at most 4 a second), until the carrier
    is closed or gone."""
    while True:
        c = carrier()
        if c is None:
            return
        period = min(max(c.timeout / 4, 0.005), 0.25)
        del c
        if stop.wait(period):
            return
        c = carrier()
        if c is None:
            return
        c.check(time.monotonic())
        del c
