"""Errors of the service layer and the one table that maps every error to a gRPC status."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from kvcoord.engine import EngineError, ErrorStatus

__all__ = ["ServiceError", "grpc_code", "map_errors", "map_stream_errors"]

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """A failure decided by the service (unknown pool, limits, sessions, auth)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ENGINE_CODES: dict[ErrorStatus, grpc.StatusCode] = {
    ErrorStatus.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorStatus.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorStatus.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorStatus.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}


def grpc_code(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message an exception becomes on the wire.

    Unknown exceptions become INTERNAL with a generic message; their traceback is
    logged, never sent.
    """
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, EngineError):
        return _ENGINE_CODES[exc.status], str(exc)
    logger.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal server error (see the server log)"


T = TypeVar("T")
Handler = Callable[..., Awaitable[T]]


def map_errors(fn: Handler[T]) -> Handler[T]:
    """Decorate a unary aio handler: raised errors become the mapped gRPC status."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await fn(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            code, message = grpc_code(exc)
            await context.abort(code, message)
            raise AssertionError("unreachable") from None

    return wrapper


def map_stream_errors(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Decorate a server-streaming aio handler like :func:`map_errors`."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            async for item in fn(self, request, context):
                yield item
        except Exception as exc:  # noqa: BLE001
            code, message = grpc_code(exc)
            await context.abort(code, message)

    return wrapper
