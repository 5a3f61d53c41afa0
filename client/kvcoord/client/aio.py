"""The asyncio client of the kvcoord Allocator service: the methods of
:class:`kvcoord.client.client.KVCoordClient`, each returning a coroutine of its response.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from . import _requests as rq
from . import given_up
from .api import LIST_POOLS, AsyncApi, Call, Coro, Req, Resp, Rpc, merged
from .errors import KVCoordError, OutcomeUnknownError, error_from_rpc
from .step_pieces import (
    free_pieces,
    inspect_pieces,
    joined_inspection,
    pieces,
    send_free_pieces_async,
    send_in_pieces_async,
)

__all__ = ["AsyncKVCoordClient"]

logger = logging.getLogger(__name__)


class AsyncKVCoordClient(AsyncApi):
    """asyncio client: the same methods as :class:`KVCoordClient`. Each RPC method
    builds its request when called and returns a coroutine of the same response type
    (``await client.get_pool(name)`` is a ``GetPoolResponse``)."""

    #: set by close(); later calls raise ValueError, as the blocking client's do
    closed = False

    def __init__(self, target: str | Sequence[str], **kw: Any) -> None:
        super().__init__(target, **kw)
        #: attach_key -> the ending of the session an Attach cancelled by its caller may
        #: have made (:meth:`_end_cancelled`)
        self._endings: dict[str, asyncio.Task[None]] = {}

    # grpc.aio binds interceptors (``grpc.aio`` ones, e.g. faults_aio.AsyncFaultInjector)
    # to the channel as it is made, not around it
    def _channel_factory(self, address: str, options: Any) -> Any:
        return grpc.aio.insecure_channel(address, options=options, interceptors=self._interceptors or None)

    def _secure_channel_factory(self, address: str, credentials: Any, options: Any) -> Any:
        return grpc.aio.secure_channel(
            address, credentials, options=options, interceptors=self._interceptors or None
        )

    @staticmethod
    def _intercepted(channel: Any, interceptors: Sequence[Any]) -> Any:
        return channel  # (interceptors are the channel's own)

    async def __aenter__(self) -> AsyncKVCoordClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channels, once the sessions of cancelled Attaches are ended (waited
        for up to the client's ``timeout``: one not ended by then ends with its lease)."""
        if self._endings:
            _, late = await asyncio.wait(set(self._endings.values()), timeout=self.timeout)
            for task in late:
                task.cancel()
        self.closed = True
        for channel, _ in self._open.values():
            await channel.close()

    def _connection(self, address: str) -> tuple[Any, Any]:
        if self.closed:  # (grpc.aio would raise its own UsageError)
            raise ValueError("a call on a closed AsyncKVCoordClient")
        return super()._connection(address)

    async def _call(self, rpc: str, request: Any) -> Any:
        if self.closed:
            raise ValueError(f"{rpc} on a closed AsyncKVCoordClient")
        if rpc == "Attach" and (ending := self._endings.get(request.attach_key)) is not None:
            # sent again under the key of one cancelled: after its session was ended (else
            # it would be answered with that session, then detached under it)
            await asyncio.wait([ending])
        try:
            return await self._attempts(rpc, request)
        except asyncio.CancelledError:
            # Cancelled by its caller (asyncio.wait_for, a task cancelled) with an attempt
            # possibly in flight: its outcome is unknown, as after a deadline, and a copy
            # held back on the way may still arrive. Remembered as given up on, so the
            # session's next keyed calls name it and such a copy is refused, never applied
            # (given_up.py; a key the server applied keeps its answer).
            unknown = OutcomeUnknownError(grpc.StatusCode.CANCELLED, f"{rpc} cancelled by its caller")
            given_up.failed(rpc, request, unknown)
            if rpc == "Attach":
                self._end_cancelled(request)
            raise

    def _end_cancelled(self, request: pb.AttachRequest) -> None:
        """An Attach its caller cancelled may have made a session nobody holds (an
        exclusive one refuses every other Attach, POOL_EXCLUSIVE, until its lease runs
        out). In the background: the same Attach sent again under its ``attach_key``
        (the server answers with the session the first made; if the first never
        arrived, one is made now), then that session detached. The copy asks for no
        pool state and no prefix-cache reset (a session the first made is answered
        whatever it asks). An Attach this client sends again under the same key waits
        for this (a new session, never the one being ended). A copy of the first held
        back on the way and delivered after this is not covered: its session ends with
        its lease."""
        again = pb.AttachRequest()
        again.CopyFrom(request)
        again.want_pool_state = again.want_engine_state = again.reset_prefix_cache = False
        key = request.attach_key
        task = asyncio.get_running_loop().create_task(self._ended(again))
        self._endings[key] = task
        task.add_done_callback(
            lambda done: self._endings.pop(key) if self._endings.get(key) is done else None
        )

    async def _ended(self, request: pb.AttachRequest) -> None:
        try:
            made = await self._attempts("Attach", request)
            await self._attempts(
                "Detach", pb.DetachRequest(session_id=made.session_id, fence=made.fence, pool=request.pool)
            )
        except KVCoordError as err:
            logger.warning(
                "pool %r: the session of a cancelled Attach may be left until its lease ends: %s",
                request.pool,
                err,
            )

    async def _attempts(self, rpc: str, request: Any) -> Any:
        call = Call(self, rpc, request)
        while True:
            address = call.route()
            method = getattr(self._connection(address)[1], rpc)
            try:
                response = await method(request, timeout=self.timeout, metadata=self._metadata_at(address))
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, rpc)
            else:
                return call.answered(response)
            pause = call.failed(err)  # (raised outside the handler: no RpcError chained)
            if pause is not None:
                await asyncio.sleep(pause)

    async def unary(self, rpc: Rpc[Any, Req, Resp], request: Req) -> Resp:
        """Send ``request`` as ``rpc`` (routed and retried as :class:`KVCoordClient` does;
        a Step larger than ``step_piece_bytes`` or ``step_piece_ops`` in pieces, :mod:`kvcoord.client.step_pieces`).
        A keyed call built without an idempotency key gets one, and a call sequence number
        (``_requests.keyed``, written in place, as ``KVCoordClient.send_step`` does)."""
        rq.keyed(rpc.name, request)
        if rpc.name == "Step":
            step = cast(pb.StepRequest, request)
            parts = pieces(step, self.step_piece_bytes, self.step_piece_ops)
            if parts is not None:
                answer = await send_in_pieces_async(step, parts, lambda piece: self._call("Step", piece))
                return cast(Resp, answer)
        if rpc.name == "Free" and (frees := free_pieces(cast(pb.FreeRequest, request), self.step_piece_ops)):
            return cast(Resp, await send_free_pieces_async(frees, lambda piece: self._call("Free", piece)))
        if rpc.name == "InspectPool" and (
            reads := inspect_pieces(cast(pb.InspectPoolRequest, request), self.step_piece_ops)
        ):
            return cast(Resp, joined_inspection([await self._call("InspectPool", piece) for piece in reads]))
        response = await self._call(rpc.name, request)
        self._learn(rpc.name, response)  # (at any Attach, as the blocking client does)
        return cast(Resp, response)

    def list_pools(self) -> Coro[pb.ListPoolsResponse]:
        """Every pool, in name order; of a replica set, every replica's (each replica
        lists the pools it serves; one that fails to answer fails the call, one refusing it
        as another replica than the one named there, WRONG_REPLICA, is asked again once
        naming any replica of that cluster, then left out)."""
        return self._list_pools()

    async def _list_pools(self) -> pb.ListPoolsResponse:
        if len(self.routes.addresses) == 1:
            return await self.unary(LIST_POOLS, pb.ListPoolsRequest())
        answers = []
        for address in list(self.routes.addresses):
            for again in (True, False):  # (a refused one once more, under its cluster's name)
                try:
                    answers.append((address, await self._listed_at(address)))
                    break
                except grpc.RpcError as exc:
                    err = self._listing_refused(exc, address, again)
                    if err is not None:
                        raise err from None
        return merged(self.routes, answers)

    async def watch_events(
        self, pool: str, after_sequence: int = 0, fence: pb.Fence | None = None
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        """Stream KV events after ``after_sequence`` until cancelled or the server stops."""
        address, stream = self._watch(pool, after_sequence, fence)
        try:
            async for item in stream:
                yield item
        except grpc.RpcError as exc:
            raise self._watch_failed(exc, pool, address) from None
        finally:
            stream.cancel()
