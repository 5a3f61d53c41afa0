"""Bearer-token authentication for the Allocator service.

When ``[server] auth_tokens`` is non-empty, every Allocator call must carry
``authorization: Bearer <token>`` with one of them, or it fails with UNAUTHENTICATED.
Health checks and reflection stay open so that probes and tools work.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

__all__ = ["TokenAuthInterceptor"]

_OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Rejects Allocator calls without a valid bearer token."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._tokens = [t.encode() for t in tokens if t]

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                given = value[len("Bearer ") :].encode()
                return any(hmac.compare_digest(given, t) for t in self._tokens)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not self._tokens or details.method.startswith(_OPEN_PREFIXES) or self._authorized(details):
            return await continuation(details)
        handler = await continuation(details)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid bearer token: send 'authorization: Bearer <token>' (client option token=...)",
            )

        if handler is not None and handler.unary_stream is not None:

            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await deny(request, context)
                yield  # pragma: no cover - abort raised

            return grpc.unary_stream_rpc_method_handler(
                deny_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            deny,
            request_deserializer=handler.request_deserializer if handler else None,
            response_serializer=handler.response_serializer if handler else None,
        )
