"""What runs around every Allocator handler (:func:`~.servicer.add_servicer` builds the
table): request bytes parsed (a Step's in slices between other calls), an undecodable
request answered INVALID_ARGUMENT, the guard (serving, credentials, role, input bounds,
pools busy with a sliced Step) and answers sent as encoded bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from .access import FULL_ACCESS, AccessControl
from .bounds import check_request_slices
from .errors import REASON_METADATA_KEY, ServiceError, Status, grpc_code
from .mutations import SERIALIZE_SLICE_OPS
from .ownership import check_addressed
from .pool_service import Limits
from .registry import PoolRegistry
from .turns import SLICE_PAUSE, SLICE_SECONDS
from .wire_slices import parse_in_turns

__all__ = [
    "BYTES_ANSWERS",
    "SLICED_PARSE",
    "Undecodable",
    "as_is_or",
    "guard",
    "parsed_in_turns",
    "parser",
    "pool_named",
]


class Undecodable:
    """Stands for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error


def parser(cls: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Undecodable(cls.DESCRIPTOR.full_name, str(exc)[:200])

    return parse


#: methods whose request is parsed from its bytes in slices between other calls
#: (wire_slices.py: a 14.7 MB Step held the event loop 120-210 ms in gRPC's parser)
SLICED_PARSE = frozenset({"Step"})


def parsed_in_turns(cls: type[Message], behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """``behaviour`` given the request its bytes parse into, parsed in slices."""

    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request: Any = await parse_in_turns(cls, data, SLICE_SECONDS, SLICE_PAUSE)
        except (DecodeError, ValueError, RuntimeError) as exc:
            request = Undecodable(cls.DESCRIPTOR.full_name, str(exc)[:200])
        return await behaviour(request, context)

    return unary


def pool_named(request: Any, registry: PoolRegistry) -> str | None:
    """The pool a request names (by name, or by its session), or None: every pool."""
    fields = request.DESCRIPTOR.fields_by_name
    for name in ("pool", "name"):
        if name in fields:
            return str(getattr(request, name))
    if "session_id" in fields:
        s = registry.sessions.sessions.get(request.session_id)
        return s.pool if s is not None else ""
    return None


def guard(
    handler: Callable[..., Any],
    streaming: bool,
    rpc: str,
    access: AccessControl,
    serving: Callable[[], None],
    limits: Limits,
    pools_free: Callable[[Any], Awaitable[None]],
    me: Callable[[], str],
) -> Callable[..., Any]:
    """Refuse every call once the server stopped serving (``serving`` raises), and one
    meant for another replica than this server (``me()``: ownership.check_addressed),
    check the caller (access.py: credentials, then the role :data:`RPC_RULES` names)
    and refuse an undecodable request or one past an input bound (bounds.py), before
    the handler sees any of them; then wait until no Step is applied in slices to a
    pool the call may touch (``pools_free``)."""

    async def admit(request: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            serving()
            metadata = context.invocation_metadata() or ()
            check_addressed(metadata, me())
            tenant = access.authenticate(metadata, context.auth_context) if access.required else FULL_ACCESS
            access.bind(tenant)
            if isinstance(request, Undecodable):
                raise ServiceError(Status.INVALID, _undecodable_message(request))
            for _ in check_request_slices(request, limits, SERIALIZE_SLICE_OPS):
                await asyncio.sleep(0)  # a large Step checked a slice at a time
            access.authorize(tenant, rpc, request)
        except ServiceError as exc:
            code, message = grpc_code(exc)
            trailers = ((REASON_METADATA_KEY, exc.reason.name),) if exc.reason is not None else ()
            await context.abort(code, message, trailers)

    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await admit(request, context)
            await pools_free(request)
            async for item in handler(request, context):
                yield item

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await admit(request, context)
        await pools_free(request)
        return await handler(request, context)

    return unary


def _undecodable_message(r: Undecodable) -> str:
    return f"the request is not a valid {r.message_type} message ({r.error})"


#: methods whose handler may answer with the response's bytes, encoded already
BYTES_ANSWERS = frozenset({"ScorePools", "Allocate", "Free", "Step"})


def as_is_or(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A response serializer that sends bytes as they are and serializes messages."""

    def serializer(response: Any) -> bytes:
        return response if type(response) is bytes else serialize(response)

    return serializer
