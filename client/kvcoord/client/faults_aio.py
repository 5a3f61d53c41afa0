"""The asyncio client's fault injector (for tests): :mod:`kvcoord.client.faults`' faults
on a ``grpc.aio`` channel.

Put it on an asyncio client (``AsyncKVCoordClient(..., interceptors=[AsyncFaultInjector(...)])``)
to see what an asyncio worker or router does when the network misbehaves *after* the
server applied a call. The faults, their draw and their counters are the blocking
injector's (:class:`~kvcoord.client.faults.FaultRules`, same seed, same sequence):

* drop: the call reaches the server and is applied, the answer is lost (UNAVAILABLE);
* delay: the answer arrives after the caller's deadline (DEADLINE_EXCEEDED);
* duplicate: the server receives the same request twice;
* reorder: an old request is delivered again, late, after newer calls of its RPC.

The asyncio client sends every call unary (no StepStream), so only unary calls are
faulted; streams (WatchEvents) pass untouched. A late old copy goes out with a later
call of the same RPC (a call's continuation carries its RPC's serializers), so the
copies held back are kept per RPC.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from .faults import DELIVERED_FIRST, FaultRules

__all__ = ["AsyncFaultInjector"]


class AsyncFaultInjector(FaultRules, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """:class:`~kvcoord.client.faults.FaultRules` (its arguments and counters) as a
    ``grpc.aio`` unary-unary interceptor. :attr:`on_drop` is called (not awaited) once
    a dropped call was answered by the server, before its caller is told it was lost."""

    def __init__(self, seed: int, **faults: Any) -> None:
        super().__init__(seed, **faults)
        #: RPC path -> its copies held back, to be delivered late
        self._held_per_rpc: dict[str, list[tuple[Any, Any]]] = {}

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        fault, late = self._unary_draw(details, request, lambda: self._held_per_rpc.setdefault(method, []))
        if late is not None:
            # An old copy arrives after newer calls; whatever it gets back goes nowhere.
            await _deliver(continuation, *late)
        if fault in DELIVERED_FIRST:
            await _deliver(continuation, details, request)
            self._delivered(fault)
        return await continuation(details, request)


async def _deliver(continuation: Callable[..., Any], details: Any, request: Any) -> None:
    """Send a request and wait until the server has answered (the answer is discarded)."""
    call = await continuation(details, request)
    try:
        await call
    except grpc.RpcError:
        pass
