"""StepStream: Steps sent on one long-lived gRPC call, each run as a unary Step.

gRPC's own server work for a unary call (a new call, its metadata, its status) is about
twice a stream message's (bench/README.md, "StepStream"), so a client sends its Steps
on one stream when the server lists the "step_stream" capability. Nothing about a Step
changes: each message is handed to the very handler the server registered for the
unary Step (parse in slices, the guard's credentials, role, bounds and pool wait, the
mutation runner's session, fence and idempotency key, the error mapping), wrapped by
the server's interceptors exactly as a unary Step is (metrics, access log: one Step
each). The rules themselves live where the unary Step's do; this module only loops.

Messages are read, applied and answered one at a time, in order. A Step that fails
ends the stream with that Step's status (``context.abort`` in the unary path); the
messages after it are never read, so never applied, and the client resends them under
their idempotency keys. When the server stops (:meth:`StepStreams.end`), a stream
waiting for its next message is cancelled at once and one applying a Step ends after
answering it: an open stream never holds a stop for its grace period, and no Step is
cut in the middle (a message received but not yet applied is never applied).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import grpc

__all__ = ["StepStreams", "step_stream_handler"]

#: the unary Step as registered: the request's bytes and the call's context in, the
#: answer (a message or its bytes) out
UnaryStep = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]


class _CallDetails(NamedTuple):
    """What a server interceptor is told about a call (grpc.HandlerCallDetails)."""

    method: str
    invocation_metadata: Any


async def _intercepted(
    interceptors: Sequence[grpc.aio.ServerInterceptor], handler: grpc.RpcMethodHandler, details: _CallDetails
) -> grpc.RpcMethodHandler | None:
    """``handler`` as the server's interceptors, in their order, hand it to gRPC."""

    async def through(i: int, d: Any) -> Any:
        if i == len(interceptors):
            return handler
        return await interceptors[i].intercept_service(lambda d2: through(i + 1, d2), d)

    return await through(0, details)


class StepStreams:
    """A server's open StepStream calls: each one's task, and whether it waits for its
    next message (idle) or is applying a Step."""

    def __init__(self) -> None:
        self.tasks: dict[asyncio.Task[Any], bool] = {}
        self.stopping = False

    def end(self) -> None:
        """The server stops: cancel the idle streams; the others end after their Step."""
        self.stopping = True
        for task, idle in list(self.tasks.items()):
            if idle:
                task.cancel()


def step_stream_handler(
    step: grpc.RpcMethodHandler,
    step_method: str,
    streams: StepStreams,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> grpc.RpcMethodHandler:
    """The StepStream handler: every message run by ``step`` (the unary Step's registered
    handler, full method name ``step_method``) as the ``interceptors`` wrap it; its
    calls kept in ``streams``."""

    async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        handler = step
        if interceptors:
            wrapped = await _intercepted(
                interceptors, step, _CallDetails(step_method, context.invocation_metadata())
            )
            if wrapped is None:  # an interceptor refused the Step: so is every message
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{step_method} is not served")
            handler = wrapped
        unary: UnaryStep = handler.unary_unary
        task = asyncio.current_task()
        assert task is not None
        tasks = streams.tasks
        tasks[task] = True
        try:
            async for data in requests:
                tasks[task] = False
                yield await unary(data, context)
                if streams.stopping:
                    break
                tasks[task] = True
        except asyncio.CancelledError:
            if not (streams.stopping and tasks[task]):
                raise  # (the call itself cancelled)
        finally:
            del tasks[task]
        if streams.stopping:  # (a StepStream call's end, as a stopping server's unary calls end)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping: send the Step again")

    return grpc.stream_stream_rpc_method_handler(
        stream,
        request_deserializer=None,  # bytes, as the unary Step's handler takes them
        response_serializer=step.response_serializer,
    )
