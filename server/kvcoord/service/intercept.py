"""Watching RPCs from a server interceptor: the metrics (metrics.py) and the access log
(logs.py) both wrap each handler with :func:`observed`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

__all__ = ["WrappedHandlers", "observed", "status_name"]

#: called as a call starts, with its kind ("unary" or "server_stream")
Begin = Callable[[str], None]
#: called as it ends: kind, request, context, whether the handler returned, start time
#: (``time.perf_counter()``)
End = Callable[[str, Any, grpc.aio.ServicerContext, bool, float], None]


def observed(handler: grpc.RpcMethodHandler, begin: Begin | None, end: End) -> grpc.RpcMethodHandler:
    """``handler`` with ``begin`` called before each call and ``end`` after it (also when
    it raised or was cancelled). Handlers of other kinds are returned unchanged."""
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if begin is not None:
                begin("unary")
            t0 = time.perf_counter()
            ok = False
            try:
                result = await inner(request, context)
                ok = True
                return result
            finally:
                end("unary", request, context, ok, t0)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if begin is not None:
                begin("server_stream")
            t0 = time.perf_counter()
            ok = False
            try:
                async for item in inner_stream(request, context):
                    yield item
                ok = True
            finally:
                end("server_stream", request, context, ok, t0)

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler


class WrappedHandlers:
    """An interceptor's wrapped handler per method, made once: gRPC hands the
    interceptor the same handler object for a method on every call, and wrapping it
    anew each time (closures, a handler tuple, label lookups) cost more than the rest
    of the interceptor. Only methods with a handler are kept (the server's own: a
    bounded set), and a different handler for a method replaces its entry."""

    def __init__(self) -> None:
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(
        self, method: str, handler: grpc.RpcMethodHandler, wrap: Callable[[], grpc.RpcMethodHandler]
    ) -> grpc.RpcMethodHandler:
        """``handler`` of ``method`` wrapped (by ``wrap()`` the first time)."""
        known = self._by_method.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = wrap()
        self._by_method[method] = (handler, wrapped)
        return wrapped


def status_name(context: grpc.aio.ServicerContext, ok: bool) -> str:
    """The status code name a finished call ended with (``OK``, ``NOT_FOUND``, ...)."""
    code = context.code()
    if code is None:
        return "OK" if ok else "CANCELLED"
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    for known in grpc.StatusCode:
        if known.value[0] == code:
            return str(known.name)
    return "UNKNOWN"
