"""Sync and asyncio clients of the kvcoord Allocator service.

Both clients expose the same methods (built from the same request builders); the
asyncio client's methods are coroutines. Every call has a deadline; transient failures
(UNAVAILABLE) are retried with jittered backoff when the call is safe to repeat, and
mutating calls carry an idempotency key so a retry never applies an operation twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from . import _requests as rq
from .errors import KVCoordError, error_from_rpc
from .retry import DEFAULT_RETRY, RetryPolicy
from .tls import TLSOptions

__all__ = ["AsyncKVCoordClient", "KVCoordClient"]

DEFAULT_TIMEOUT = 10.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _should_retry(
    policy: RetryPolicy, err: KVCoordError, attempt: int, backoffs: list[float], start: float
) -> bool:
    """A transient code, attempts left, and the next sleep still inside the deadline."""
    return (
        err.code in policy.retry_codes
        and attempt < len(backoffs)
        and time.monotonic() - start + backoffs[attempt] < policy.deadline
    )


class _Api:
    """The call surface shared by both clients; ``_call`` decides sync or async."""

    _channel_factory: Any = None
    _secure_channel_factory: Any = None

    def __init__(
        self,
        target: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy = DEFAULT_RETRY,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        tls: TLSOptions | None = None,
    ) -> None:
        """Open a channel to ``target`` (``host:port`` or ``unix:/path``).

        Args:
            timeout: deadline of each attempt, in seconds.
            retry: retry settings for calls that are safe to repeat.
            max_message_bytes: send/receive limit (match the server's for large Steps).
            token: bearer token, when the server sets ``auth_tokens``.
            tls: connect over TLS (mutual TLS with a client certificate); ``None`` is plaintext.

        Raises:
            ValueError: a TLS file is unreadable or invalid (named in the message).
        """
        self.target = target
        self.timeout = timeout
        self.retry = retry
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = rq.channel_options(max_message_bytes)
        if tls is None:
            self.channel = self._channel_factory(target, options=options)
        else:
            self.channel = self._secure_channel_factory(
                target, tls.credentials(), options=[*options, *tls.channel_options()]
            )
        self.stub = pb_grpc.AllocatorStub(self.channel)

    def _call(self, rpc: str, request: Any) -> Any:
        raise NotImplementedError

    def create_pool(self, name: str, config: pb.PoolConfig) -> Any:
        """Create a pool (a no-op when an identical one exists). Returns CreatePoolResponse."""
        return self._call("CreatePool", pb.CreatePoolRequest(name=name, config=config))

    def get_pool(self, name: str) -> Any:
        """GetPoolResponse for ``name``."""
        return self._call("GetPool", pb.GetPoolRequest(name=name))

    def list_pools(self) -> Any:
        return self._call("ListPools", pb.ListPoolsRequest())

    def delete_pool(self, name: str) -> Any:
        return self._call("DeletePool", pb.DeletePoolRequest(name=name))

    def attach(
        self,
        pool: str,
        hash_algo: str,
        hash_block_size: int,
        hash_seed: str,
        client_name: str = "",
        lease_seconds: int = 0,
    ) -> Any:
        """Hash handshake; AttachResponse with a session id. HashMismatchError on a mismatch."""
        return self._call(
            "Attach", rq.attach(pool, hash_algo, hash_block_size, hash_seed, client_name, lease_seconds)
        )

    def heartbeat(self, session_id: str) -> Any:
        return self._call("Heartbeat", pb.HeartbeatRequest(session_id=session_id))

    def detach(self, session_id: str) -> Any:
        return self._call("Detach", pb.DetachRequest(session_id=session_id))

    def find_longest_cache_hit(self, pool: str, request: pb.RequestSync, session_id: str = "") -> Any:
        return self._call(
            "FindLongestCacheHit",
            pb.FindLongestCacheHitRequest(pool=pool, session_id=session_id, request=request),
        )

    def allocate(self, pool: str, op: pb.AllocateOp, session_id: str = "") -> Any:
        """allocate_slots; AllocateResponse (result.refused when out of blocks)."""
        return self._call("Allocate", rq.allocate(pool, op, session_id))

    def free(self, pool: str, request_ids: Iterable[str], preempt: bool = False, session_id: str = "") -> Any:
        return self._call("Free", rq.free(pool, request_ids, preempt, session_id))

    def step(self, pool: str, ops: Sequence[pb.Operation], session_id: str = "") -> Any:
        """Apply ``ops`` in order in one round trip; StepResponse with one result each."""
        return self._call("Step", rq.step(pool, ops, session_id))

    def reset_prefix_cache(self, pool: str, session_id: str = "") -> Any:
        return self._call("ResetPrefixCache", pb.ResetPrefixCacheRequest(pool=pool, session_id=session_id))

    def get_stats(self, pool: str) -> Any:
        return self._call("GetStats", pb.GetStatsRequest(pool=pool))

    def inspect_pool(
        self,
        pool: str,
        free_queue_limit: int = 0,
        request_ids: Iterable[str] = (),
        *,
        all_requests: bool = False,
        include_cached_blocks: bool = False,
    ) -> Any:
        """Block tables, free-queue head and cached blocks, read in one consistent step."""
        return self._call(
            "InspectPool",
            pb.InspectPoolRequest(
                pool=pool,
                free_queue_limit=free_queue_limit,
                request_ids=list(request_ids),
                all_requests=all_requests,
                include_cached_blocks=include_cached_blocks,
            ),
        )


class KVCoordClient(_Api):
    """Blocking client.

    Args:
        target: ``host:port`` or ``unix:/path``.
        timeout: deadline of each attempt, in seconds.
        retry: retry settings for calls that are safe to repeat.
        max_message_bytes: send/receive limit (match the server's for large Steps).
        token: bearer token, when the server sets ``auth_tokens``.
        tls: :class:`TLSOptions` for a TLS listener; ``None`` is plaintext.
    """

    _channel_factory = staticmethod(grpc.insecure_channel)
    _secure_channel_factory = staticmethod(grpc.secure_channel)

    def __enter__(self) -> KVCoordClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, rpc: str, request: Any) -> Any:
        method = getattr(self.stub, rpc)
        retried = rq.RPCS[rpc]
        start = time.monotonic()
        backoffs = self.retry.backoffs() if retried else []
        attempt = 0
        while True:
            try:
                return method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, rpc)
                if not _should_retry(self.retry, err, attempt, backoffs, start):
                    raise err from None
                time.sleep(backoffs[attempt])
                attempt += 1

    def watch_events(
        self, pool: str, after_sequence: int = 0, timeout: float | None = None
    ) -> Iterator[pb.WatchEventsResponse]:
        """Stream KV events after ``after_sequence``; ends when the server stops or ``timeout`` passes."""
        stream = self.stub.WatchEvents(
            pb.WatchEventsRequest(pool=pool, after_sequence=after_sequence),
            timeout=timeout,
            metadata=self._metadata,
        )
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise error_from_rpc(exc) from None
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


class AsyncKVCoordClient(_Api):
    """asyncio client: the same methods as :class:`KVCoordClient`, as coroutines."""

    _channel_factory = staticmethod(grpc.aio.insecure_channel)
    _secure_channel_factory = staticmethod(grpc.aio.secure_channel)

    async def __aenter__(self) -> AsyncKVCoordClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, rpc: str, request: Any) -> Any:
        method = getattr(self.stub, rpc)
        backoffs = self.retry.backoffs() if rq.RPCS[rpc] else []
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return await method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, rpc)
                if not _should_retry(self.retry, err, attempt, backoffs, start):
                    raise err from None
                await asyncio.sleep(backoffs[attempt])
                attempt += 1

    async def watch_events(self, pool: str, after_sequence: int = 0) -> AsyncIterator[pb.WatchEventsResponse]:
        """Stream KV events after ``after_sequence`` until cancelled or the server stops."""
        stream = self.stub.WatchEvents(
            pb.WatchEventsRequest(pool=pool, after_sequence=after_sequence), metadata=self._metadata
        )
        try:
            async for item in stream:
                yield item
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            stream.cancel()
