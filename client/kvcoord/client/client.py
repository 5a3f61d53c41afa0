"""The blocking client of the kvcoord Allocator service (:mod:`kvcoord.client.aio` has
the asyncio one, with the same methods).

Every call has a deadline; transient failures (UNAVAILABLE) are retried with jittered
backoff when the call is safe to repeat, and mutating calls carry an idempotency key so
a retry never applies an operation twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvcoord.v1 import allocator_pb2 as pb

from . import _requests as rq
from .api import LIST_POOLS, BlockingApi, Call, Req, Resp, Rpc, merged
from .errors import error_from_rpc
from .step_pieces import (
    free_pieces,
    inspect_pieces,
    joined_inspection,
    ops_cap,
    pieces,
    send_free_pieces,
    send_in_pieces,
)
from .stream_carrier import STEP_STREAM, StepCarrier

__all__ = ["KVCoordClient"]


class KVCoordClient(BlockingApi):
    """Blocking client.

    Args:
        target: ``host:port`` or ``unix:/path``.
        timeout: deadline of each attempt, in seconds.
        retry: retry settings for calls that are safe to repeat.
        max_message_bytes: send/receive limit (match the server's for large Steps).
        token: bearer token, when the server sets ``auth_tokens``.
        tls: :class:`TLSOptions` for a TLS listener; ``None`` is plaintext.
        step_stream: send Steps on one StepStream call per replica when the replica
            lists the "step_stream" capability at Attach (stream_carrier.py); False:
            every Step is a unary call.
    """

    _channel_factory = staticmethod(grpc.insecure_channel)
    _secure_channel_factory = staticmethod(grpc.secure_channel)

    def __init__(self, target: str | Sequence[str], *, step_stream: bool = True, **kw: Any) -> None:
        super().__init__(target, **kw)
        self.step_stream = step_stream
        #: the replicas that serve StepStream (their Attach answer listed it)
        self._streamed: set[str] = set()
        self._carrier = StepCarrier(
            lambda address: self._connection(address)[1], self._metadata_at, self.timeout
        )

    def __enter__(self) -> KVCoordClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    #: set by close(); later calls raise ValueError before touching the channel
    closed = False

    def close(self) -> None:
        self.closed = True
        self._carrier.close()
        for channel, _ in self._open.values():
            channel.close()

    def _call(self, rpc: str, request: Any) -> Any:
        if self.closed:
            # grpcio crashes the process when an intercepted channel is used after
            # close (a plain one raises this same ValueError): never reach it
            raise ValueError(f"{rpc} on a closed KVCoordClient")
        call = Call(self, rpc, request)
        while True:
            try:
                response = self._attempt(rpc, request, call.route())
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, rpc)
            else:
                return call.answered(response)
            pause = call.failed(err)  # (raised outside the handler: no RpcError chained)
            if pause is not None:
                time.sleep(pause)

    def _attempt(self, rpc: str, request: Any, address: str) -> Any:
        """One attempt of the call at ``address``: a Step on the replica's stream when it
        serves StepStream, any other call (or a Step the stream cannot take) unary."""
        if rpc == "Step" and address in self._streamed:
            answer = self._streamed_step(address, request)
            if answer is not None:
                return answer
        response = getattr(self._connection(address)[1], rpc)(
            request, timeout=self.timeout, metadata=self._metadata_at(address)
        )
        if rpc == "Attach" and self.step_stream and STEP_STREAM in response.capabilities:
            self._streamed.add(address)
        return response

    def _streamed_step(self, address: str, request: pb.StepRequest) -> pb.StepResponse | None:
        """A Step sent on ``address``'s stream; None: send it unary (another thread's
        Step is on the stream, or the replica no longer serves StepStream: a server
        restarted at an older version, which applied nothing of it)."""
        try:
            return self._carrier.try_send(address, request)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._streamed.discard(address)
            return None

    def unary(self, rpc: Rpc[Any, Req, Resp], request: Req) -> Resp:
        """Send ``request`` as ``rpc``: to the pool's owner, retried as the call's kind
        allows (``_requests.RPCS``); the response, or a typed :class:`KVCoordError`. A
        keyed call built without an idempotency key gets one (``_requests.keyed``, in
        place). A Step goes through :meth:`send_step`."""
        if rpc.name == "Step":
            return cast(Resp, self.send_step(cast(pb.StepRequest, request)))
        rq.keyed(rpc.name, request)  # (a caller's request without a key: retried under one)
        if rpc.name == "Free" and (frees := free_pieces(cast(pb.FreeRequest, request), self.step_piece_ops)):
            return cast(Resp, send_free_pieces(frees, lambda piece: self._call("Free", piece)))
        if rpc.name == "InspectPool" and (
            reads := inspect_pieces(cast(pb.InspectPoolRequest, request), self.step_piece_ops)
        ):
            return cast(Resp, joined_inspection([self._call("InspectPool", piece) for piece in reads]))
        response = self._call(rpc.name, request)
        if (cap := ops_cap(rpc.name, response)) is not None:
            # (the idempotency window is learned by a session keeper: a caller's own
            # attach leaves retry_horizon as it is, and its calls may outlast long restarts)
            self.step_piece_ops = cap
        return cast(Resp, response)

    def list_pools(self) -> pb.ListPoolsResponse:
        """Every pool, in name order; of a replica set, every replica's (each replica
        lists the pools it serves; one that fails to answer fails the call, one refusing it
        as another replica than the one named there, WRONG_REPLICA, is asked again once
        naming any replica of that cluster, then left out)."""
        if len(self.routes.addresses) == 1:
            return self.unary(LIST_POOLS, pb.ListPoolsRequest())
        answers = []
        for address in list(self.routes.addresses):
            for again in (True, False):  # (a refused one once more, under its cluster's name)
                try:
                    answers.append((address, self._listed_at(address)))
                    break
                except grpc.RpcError as exc:
                    err = self._listing_refused(exc, address, again)
                    if err is not None:
                        raise err from None
        return merged(self.routes, answers)

    def send_step(self, request: pb.StepRequest) -> pb.StepResponse:
        """``step`` for a request the caller built (its operations written in place,
        so nothing is copied); a request without an idempotency key gets one and a call
        sequence number. One whose caller gave it a key is sent with the number it has
        (none when 0: a copy of it delivered after the server forgot its key would be
        applied). One larger than ``step_piece_bytes``, or of more operations than
        ``step_piece_ops``, is sent in pieces (:mod:`kvcoord.client.step_pieces`)."""
        rq.keyed("Step", request)
        parts = pieces(request, self.step_piece_bytes, self.step_piece_ops)
        if parts is not None:
            return send_in_pieces(request, parts, lambda piece: self._call("Step", piece))
        return cast(pb.StepResponse, self._call("Step", request))

    def watch_events(
        self,
        pool: str,
        after_sequence: int = 0,
        timeout: float | None = None,
        fence: pb.Fence | None = None,
    ) -> Iterator[pb.WatchEventsResponse]:
        """Stream KV events after ``after_sequence`` (of the history ``fence`` names, when
        resuming); ends when the server stops or ``timeout`` passes. Check ``gap`` and
        ``reset`` on every message."""
        address, stream = self._watch(pool, after_sequence, fence, timeout=timeout)
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._watch_failed(exc, pool, address) from None
        finally:
            stream.cancel()

    def health(self, service: str = "") -> str:
        """The server's health status name (SERVING, NOT_SERVING, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
