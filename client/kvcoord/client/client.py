"""Sync and asyncio clients of the kvcoord Allocator service.

Both clients expose the same methods (built from the same request builders), each typed
with its response message; the asyncio client's methods return coroutines of them. Every call has a deadline; transient failures
(UNAVAILABLE) are retried with jittered backoff when the call is safe to repeat, and
mutating calls carry an idempotency key so a retry never applies an operation twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeAlias, TypeVar, cast

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from . import _requests as rq
from . import errors as _errors
from .errors import KVCoordError, NotOwnerError, OutcomeUnknownError, UnavailableError, error_from_rpc
from .owners import MAX_HOPS, Routes
from .retry import DEFAULT_RETRY, RetryPolicy
from .tls import TLSOptions

__all__ = ["AsyncKVCoordClient", "KVCoordClient"]

DEFAULT_TIMEOUT = 10.0
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the server's default max_message_bytes


#: Codes after which a call may or may not have reached the server (CANCELLED: the
#: client cancels none of its calls; a server stopping mid-call or a proxy did).
_UNKNOWN_OUTCOME = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


class _Attempts:
    """Decides, after each failed attempt of one call, whether to try again.

    Read-only and keyed calls are retried after a transient failure (a keyed call
    with the same idempotency key, so it is applied at most once) until the policy's
    attempts or deadline run out, and never past ``horizon`` (half the server's
    idempotency window: a retry must reach the server while it still keeps the
    answer). A keyed or once-only call whose outcome is still unknown then raises
    :class:`OutcomeUnknownError`: the caller must treat it as possibly applied.
    """

    def __init__(self, policy: RetryPolicy, kind: str, horizon: float) -> None:
        self.policy = policy
        self.kind = kind
        self.start = time.monotonic()
        self.keyed_longer = kind == "keyed" and policy.retries_keyed_longer()
        longest = policy.keyed_deadline if self.keyed_longer and policy.keyed_deadline else policy.deadline
        self.deadline = min(longest, horizon)
        #: drawn at the first failure (seeding a generator costs ~10 us, every call)
        self.backoffs: list[float] | None = None if kind != "once" else []
        self.attempt = 0

    def settling(self, err: KVCoordError) -> bool:
        """``err`` is a redirect still left after MAX_HOPS: the replicas disagree on
        the owner for a moment (a claim changing hands, a view not yet re-read). A
        NOT_OWNER answer applied nothing, so a call that may be repeated anyway (a
        read, a keyed call, an Attach) waits and starts over; an unkeyed mutation
        ("once") still raises it."""
        return isinstance(err, NotOwnerError) and self.kind in ("read", "keyed", "attach")

    def next_sleep(self, err: KVCoordError) -> float:
        """Seconds to sleep before the next attempt; raises the final error instead."""
        retryable = (
            err.code in self.policy.retry_codes
            or (self.kind == "keyed" and err.code in _UNKNOWN_OUTCOME)
            or self.settling(err)
        )
        if self.backoffs is None:
            count = None
            if self.keyed_longer:  # enough sleeps to reach the deadline, the deadline decides
                count = max(
                    self.policy.max_attempts - 1, int(self.deadline / max(self.policy.initial_backoff, 0.01))
                )
            self.backoffs = self.policy.backoffs(count=count)
        if (
            retryable
            and self.attempt < len(self.backoffs)
            and time.monotonic() - self.start + self.backoffs[self.attempt] < self.deadline
        ):
            self.attempt += 1
            return self.backoffs[self.attempt - 1]
        if self.kind in ("keyed", "once") and err.code in _UNKNOWN_OUTCOME and type(err) is UnavailableError:
            raise OutcomeUnknownError(
                err.code,
                f"the outcome of this call is unknown after {self.attempt + 1} attempt(s): {err.message}",
            ) from err
        raise err


_Req = TypeVar("_Req", bound=Message)
_Resp = TypeVar("_Resp", bound=Message)
_T = TypeVar("_T")

#: what the asyncio client's RPC methods return: a coroutine of the response
_Coro: TypeAlias = Coroutine[Any, Any, _T]


@dataclasses.dataclass(frozen=True)
class _Rpc(Generic[_Req, _Resp]):
    """One unary RPC of the Allocator service: its name (the stub's attribute and the key
    of ``_requests.RPCS``) and its message types, which type each client method."""

    name: str
    request: type[_Req]
    response: type[_Resp]


_CREATE_POOL = _Rpc("CreatePool", pb.CreatePoolRequest, pb.CreatePoolResponse)
_GET_POOL = _Rpc("GetPool", pb.GetPoolRequest, pb.GetPoolResponse)
_LIST_POOLS = _Rpc("ListPools", pb.ListPoolsRequest, pb.ListPoolsResponse)
_DELETE_POOL = _Rpc("DeletePool", pb.DeletePoolRequest, pb.DeletePoolResponse)
_ATTACH = _Rpc("Attach", pb.AttachRequest, pb.AttachResponse)
_HEARTBEAT = _Rpc("Heartbeat", pb.HeartbeatRequest, pb.HeartbeatResponse)
_DETACH = _Rpc("Detach", pb.DetachRequest, pb.DetachResponse)
_FIND_LONGEST_CACHE_HIT = _Rpc(
    "FindLongestCacheHit", pb.FindLongestCacheHitRequest, pb.FindLongestCacheHitResponse
)
_ALLOCATE = _Rpc("Allocate", pb.AllocateRequest, pb.AllocateResponse)
_FREE = _Rpc("Free", pb.FreeRequest, pb.FreeResponse)
_STEP = _Rpc("Step", pb.StepRequest, pb.StepResponse)
_RESET_PREFIX_CACHE = _Rpc("ResetPrefixCache", pb.ResetPrefixCacheRequest, pb.ResetPrefixCacheResponse)
_GET_STATS = _Rpc("GetStats", pb.GetStatsRequest, pb.GetStatsResponse)
_INSPECT_POOL = _Rpc("InspectPool", pb.InspectPoolRequest, pb.InspectPoolResponse)
_CHECK_POOL = _Rpc("CheckPool", pb.CheckPoolRequest, pb.CheckPoolResponse)
_SCORE_POOLS = _Rpc("ScorePools", pb.ScorePoolsRequest, pb.ScorePoolsResponse)
_LIST_SESSIONS = _Rpc("ListSessions", pb.ListSessionsRequest, pb.ListSessionsResponse)

#: every unary RPC the clients call, with the method that calls it (tests check this
#: against the service descriptor, ``_requests.RPCS`` and both clients' methods)
UNARY_METHODS: dict[str, _Rpc[Any, Any]] = {
    "create_pool": _CREATE_POOL,
    "get_pool": _GET_POOL,
    "list_pools": _LIST_POOLS,
    "delete_pool": _DELETE_POOL,
    "attach": _ATTACH,
    "heartbeat": _HEARTBEAT,
    "detach": _DETACH,
    "find_longest_cache_hit": _FIND_LONGEST_CACHE_HIT,
    "allocate": _ALLOCATE,
    "free": _FREE,
    "step": _STEP,
    "reset_prefix_cache": _RESET_PREFIX_CACHE,
    "get_stats": _GET_STATS,
    "inspect_pool": _INSPECT_POOL,
    "check_pool": _CHECK_POOL,
    "score_pools": _SCORE_POOLS,
    "list_sessions": _LIST_SESSIONS,
}


def _merged(routes: Routes, answers: Sequence[tuple[str, pb.ListPoolsResponse]]) -> pb.ListPoolsResponse:
    """Several replicas' pool lists as one, in name order (a pool two replicas list
    while it moves: the first listing); each pool's owner is remembered."""
    pools: dict[str, pb.PoolInfo] = {}
    for address, answer in answers:
        for info in answer.pools:
            if info.name not in pools:
                pools[info.name] = info
                routes.owner[info.name] = address
    return pb.ListPoolsResponse(pools=[pools[n] for n in sorted(pools)])


class _Api:
    """The channel set-up shared by both clients. Each client defines the RPC methods
    itself, typed with their response (the asyncio client's as coroutines), and builds
    their requests with the same code (``_requests``); ``_call`` is its transport."""

    _channel_factory: Any = None
    _secure_channel_factory: Any = None

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy = DEFAULT_RETRY,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        interceptors: Sequence[Any] = (),
        tls: TLSOptions | None = None,
    ) -> None:
        """Open a channel to ``target`` (``host:port`` or ``unix:/path``), or to a
        replica set: a list of addresses (or one string of them, comma-separated), or
        a DNS name whose A records are the replicas (a headless Service). Each pool's
        calls go to its owner: a NOT_OWNER answer names it and is followed (at most
        :data:`~kvcoord.client.owners.MAX_HOPS` times per call), and an owner that
        does not answer is forgotten (the names are resolved again).

        Args:
            timeout: deadline of each attempt, in seconds.
            retry: retry settings for calls that are safe to repeat.
            max_message_bytes: send/receive limit (match the server's for large Steps).
            token: bearer token, when the server sets ``auth_tokens``.
            interceptors: gRPC client interceptors for the channel (e.g. FaultInjector).
            tls: connect over TLS (mutual TLS with a client certificate); ``None`` is plaintext.

        Raises:
            ValueError: a TLS file is unreadable or invalid (named in the message).
        """
        #: the replica set and each pool's owner as last learned (owners.py)
        self.routes = Routes(target)
        self.target = target if isinstance(target, str) else ",".join(target)
        self.timeout = timeout
        self.retry = retry
        #: how long keyed calls may be retried: half the server's idempotency window
        #: (learned at attach; the server's default until then)
        self.retry_horizon = 150.0
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._options = rq.channel_options(max_message_bytes)
        self._tls = tls
        self._interceptors = interceptors
        #: address -> (channel, stub), opened on first use
        self._open: dict[str, tuple[Any, Any]] = {}
        self.channel, self.stub = self._connection(self.routes.primary)

    def _connection(self, address: str) -> tuple[Any, Any]:
        """The channel and stub to ``address`` (opened on first use)."""
        got = self._open.get(address)
        if got is None:
            tls = self._tls
            if tls is None:
                channel = self._channel_factory(address, options=self._options)
            else:
                channel = self._secure_channel_factory(
                    address, tls.credentials(), options=[*self._options, *tls.channel_options()]
                )
            got = (channel, pb_grpc.AllocatorStub(self._intercepted(channel, self._interceptors)))
            self._open[address] = got
        return got

    def _routed(self, err: KVCoordError, pool: str, address: str, hops: int, rpc: str = "") -> bool:
        """After a failed attempt: True to call again at once (a NOT_OWNER redirect to
        follow, or a read whose remembered owner stopped answering and another replica
        is now the one to ask); an unreachable owner is forgotten (otherwise the caller's
        retry policy decides whether to try again, at another replica)."""
        if isinstance(err, NotOwnerError) and err.owner and pool and hops < MAX_HOPS:
            self.routes.redirected(pool, err.owner)
            return True
        if isinstance(err, UnavailableError) and pool:
            self.routes.unreachable(pool, address)
            # Another replica now routes the call: sent there at once when this one never
            # got it (no connection: any call), or a read ended in DEADLINE_EXCEEDED (a
            # stopped owner's address may swallow packets; no retry policy repeats it).
            late_read = err.code == grpc.StatusCode.DEADLINE_EXCEEDED and rq.RPCS.get(rpc) == "read"
            moved = hops < MAX_HOPS and self.routes.route(pool) != address
            return (_errors.never_sent(err) or late_read) and moved
        return False

    @staticmethod
    def _intercepted(channel: Any, interceptors: Sequence[Any]) -> Any:
        return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


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

    #: set by close(); later calls raise ValueError before touching the channel
    closed = False

    def close(self) -> None:
        self.closed = True
        for channel, _ in self._open.values():
            channel.close()

    def _call(self, rpc: str, request: Any) -> Any:
        if self.closed:
            # grpcio crashes the process when an intercepted channel is used after
            # close (a plain one raises this same ValueError): never reach it
            raise ValueError(f"{rpc} on a closed KVCoordClient")
        routes = self.routes
        pool = routes.pool_of(rpc, request)
        attempts = _Attempts(self.retry, rq.RPCS[rpc], self.retry_horizon)
        hops = 0
        while True:
            address = routes.route(pool)
            method = getattr(self._connection(address)[1], rpc)
            try:
                response = method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, rpc)
            else:
                routes.answered(rpc, request, response, pool, address)
                return response
            if self._routed(err, pool, address, hops, rpc):
                hops += 1
                continue
            time.sleep(attempts.next_sleep(err))
            if attempts.settling(err):
                hops = 0  # the redirects are followed again after the pause

    def _unary(self, rpc: _Rpc[_Req, _Resp], request: _Req) -> _Resp:
        return cast(_Resp, self._call(rpc.name, request))

    def create_pool(self, name: str, config: pb.PoolConfig) -> pb.CreatePoolResponse:
        """Create a pool (a no-op when an identical one exists)."""
        return self._unary(_CREATE_POOL, pb.CreatePoolRequest(name=name, config=config))

    def get_pool(self, name: str) -> pb.GetPoolResponse:
        """The pool ``name``: its configuration and state."""
        return self._unary(_GET_POOL, pb.GetPoolRequest(name=name))

    def list_pools(self) -> pb.ListPoolsResponse:
        """Every pool, in name order; of a replica set, every replica's (each replica
        lists the pools it serves; one that fails to answer fails the call)."""
        if len(self.routes.addresses) == 1:
            return self._unary(_LIST_POOLS, pb.ListPoolsRequest())
        answers = []
        for address in list(self.routes.addresses):
            try:
                answer = self._connection(address)[1].ListPools(
                    pb.ListPoolsRequest(), timeout=self.timeout, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, "ListPools") from None
            answers.append((address, answer))
        return _merged(self.routes, answers)

    def delete_pool(self, name: str) -> pb.DeletePoolResponse:
        return self._unary(_DELETE_POOL, pb.DeletePoolRequest(name=name))

    def attach(
        self,
        pool: str,
        hash_algo: str,
        hash_block_size: int,
        hash_seed: str,
        client_name: str = "",
        lease_seconds: float = 0,
        exclusive: bool = False,
        want_pool_state: bool = False,
        want_engine_state: bool = False,
        profile: str = "",
        num_hash_lookahead_tokens: int = 0,
    ) -> pb.AttachResponse:
        """Hash handshake: a session id and fence. HashMismatchError on a mismatch,
        ProfileMismatchError when the pool follows another ``profile``.
        ``want_pool_state`` (with ``exclusive``): the answer carries the pool's state
        (with ``want_engine_state``, the engine's own state, for a mirror)."""
        return self._unary(
            _ATTACH,
            rq.attach(
                pool,
                hash_algo,
                hash_block_size,
                hash_seed,
                client_name,
                lease_seconds,
                exclusive,
                want_pool_state,
                want_engine_state,
                profile,
                num_hash_lookahead_tokens,
            ),
        )

    def heartbeat(self, session_id: str, fence: pb.Fence | None = None) -> pb.HeartbeatResponse:
        """Renew a session lease; SessionExpiredError / FencedError when lost."""
        return self._unary(_HEARTBEAT, pb.HeartbeatRequest(session_id=session_id, fence=fence))

    def detach(self, session_id: str, fence: pb.Fence | None = None) -> pb.DetachResponse:
        return self._unary(_DETACH, pb.DetachRequest(session_id=session_id, fence=fence))

    def find_longest_cache_hit(
        self, pool: str, block_hashes: Sequence[bytes], num_tokens: int
    ) -> pb.FindLongestCacheHitResponse:
        """Read-only longest hit for these hashes; changes nothing."""
        return self._unary(_FIND_LONGEST_CACHE_HIT, rq.find_longest_cache_hit(pool, block_hashes, num_tokens))

    def allocate(
        self, pool: str, op: pb.AllocateOp, session_id: str, fence: pb.Fence | None = None
    ) -> pb.AllocateResponse:
        """allocate_slots (``result.refused`` when out of blocks)."""
        return self._unary(_ALLOCATE, rq.allocate(pool, op, session_id, fence))

    def free(
        self,
        pool: str,
        request_ids: Iterable[str],
        preempt: bool = False,
        session_id: str = "",
        fence: pb.Fence | None = None,
    ) -> pb.FreeResponse:
        return self._unary(_FREE, rq.free(pool, request_ids, preempt, session_id, fence))

    def step(
        self,
        pool: str,
        ops: Sequence[pb.Operation],
        session_id: str,
        fence: pb.Fence | None = None,
        include_state: bool = False,
    ) -> pb.StepResponse:
        """Apply ``ops`` in order in one round trip: one result each (and the session's
        new events and statistics with ``include_state``)."""
        return self._unary(_STEP, rq.step(pool, ops, session_id, fence, include_state))

    def send_step(self, request: pb.StepRequest) -> pb.StepResponse:
        """:meth:`step` for a request the caller built (its operations written in place,
        so nothing is copied); an idempotency key is added when it has none."""
        if not request.idempotency_key:
            request.idempotency_key = rq.key()
        return self._unary(_STEP, request)

    def reset_prefix_cache(
        self, pool: str, session_id: str = "", fence: pb.Fence | None = None
    ) -> pb.ResetPrefixCacheResponse:
        return self._unary(
            _RESET_PREFIX_CACHE, pb.ResetPrefixCacheRequest(pool=pool, session_id=session_id, fence=fence)
        )

    def get_stats(self, pool: str) -> pb.GetStatsResponse:
        return self._unary(_GET_STATS, pb.GetStatsRequest(pool=pool))

    def inspect_pool(
        self,
        pool: str,
        free_queue_limit: int = 0,
        request_ids: Iterable[str] = (),
        *,
        all_requests: bool = False,
        include_cached_blocks: bool = False,
    ) -> pb.InspectPoolResponse:
        """Block tables, free-queue head and cached blocks, read in one consistent step."""
        return self._unary(
            _INSPECT_POOL,
            rq.inspect_pool(pool, free_queue_limit, request_ids, all_requests, include_cached_blocks),
        )

    def score_pools(
        self,
        num_tokens: int,
        prompts: Sequence[pb.HashedPrompt],
        candidate_pools: Sequence[str] = (),
        include_block_ids: bool = False,
        reserve_seconds: float = 0.0,
    ) -> pb.ScorePoolsResponse:
        """Exact prefix-cache scores of a prompt in many pools, best first (read-only;
        needs observe on each pool). ``prompts``: the prompt hashed once per pool hash
        settings (:func:`kvcoord.client.routing.hash_prompt`); ``candidate_pools``: the
        pools to score (empty: every pool the caller may observe); ``reserve_seconds``:
        hold the best pool's hit that long, until a request of the prompt adopts it."""
        return self._unary(
            _SCORE_POOLS,
            rq.score_pools(num_tokens, prompts, candidate_pools, include_block_ids, reserve_seconds),
        )

    def check_pool(self, pool: str) -> pb.CheckPoolResponse:
        """The pool's invariant violations (none when it is sound); read-only, linear in its size."""
        return self._unary(_CHECK_POOL, pb.CheckPoolRequest(pool=pool))

    def list_sessions(self, pool: str) -> pb.ListSessionsResponse:
        """The pool's live sessions, every tenant's (administer role); read-only."""
        return self._unary(_LIST_SESSIONS, pb.ListSessionsRequest(pool=pool))

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
        stream = self._connection(self.routes.route(pool))[1].WatchEvents(
            pb.WatchEventsRequest(pool=pool, after_sequence=after_sequence, fence=fence),
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
    """asyncio client: the same methods as :class:`KVCoordClient`. Each RPC method
    builds its request when called and returns a coroutine of the same response type
    (``await client.get_pool(name)`` is a ``GetPoolResponse``)."""

    _channel_factory = staticmethod(grpc.aio.insecure_channel)
    _secure_channel_factory = staticmethod(grpc.aio.secure_channel)

    @staticmethod
    def _intercepted(channel: Any, interceptors: Sequence[Any]) -> Any:
        if interceptors:
            raise ValueError("AsyncKVCoordClient takes no interceptors (grpc.aio binds them per channel)")
        return channel

    async def __aenter__(self) -> AsyncKVCoordClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel, _ in self._open.values():
            await channel.close()

    async def _call(self, rpc: str, request: Any) -> Any:
        routes = self.routes
        pool = routes.pool_of(rpc, request)
        attempts = _Attempts(self.retry, rq.RPCS[rpc], self.retry_horizon)
        hops = 0
        while True:
            address = routes.route(pool)
            method = getattr(self._connection(address)[1], rpc)
            try:
                response = await method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc, rpc)
            else:
                routes.answered(rpc, request, response, pool, address)
                return response
            if self._routed(err, pool, address, hops, rpc):
                hops += 1
                continue
            await asyncio.sleep(attempts.next_sleep(err))
            if attempts.settling(err):
                hops = 0  # the redirects are followed again after the pause

    async def _unary(self, rpc: _Rpc[_Req, _Resp], request: _Req) -> _Resp:
        return cast(_Resp, await self._call(rpc.name, request))

    def create_pool(self, name: str, config: pb.PoolConfig) -> _Coro[pb.CreatePoolResponse]:
        """Create a pool (a no-op when an identical one exists)."""
        return self._unary(_CREATE_POOL, pb.CreatePoolRequest(name=name, config=config))

    def get_pool(self, name: str) -> _Coro[pb.GetPoolResponse]:
        """The pool ``name``: its configuration and state."""
        return self._unary(_GET_POOL, pb.GetPoolRequest(name=name))

    def list_pools(self) -> _Coro[pb.ListPoolsResponse]:
        """Every pool, in name order; of a replica set, every replica's (each replica
        lists the pools it serves; one that fails to answer fails the call)."""
        return self._list_pools()

    async def _list_pools(self) -> pb.ListPoolsResponse:
        if len(self.routes.addresses) == 1:
            return await self._unary(_LIST_POOLS, pb.ListPoolsRequest())
        answers = []
        for address in list(self.routes.addresses):
            try:
                answer = await self._connection(address)[1].ListPools(
                    pb.ListPoolsRequest(), timeout=self.timeout, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, "ListPools") from None
            answers.append((address, answer))
        return _merged(self.routes, answers)

    def delete_pool(self, name: str) -> _Coro[pb.DeletePoolResponse]:
        return self._unary(_DELETE_POOL, pb.DeletePoolRequest(name=name))

    def attach(
        self,
        pool: str,
        hash_algo: str,
        hash_block_size: int,
        hash_seed: str,
        client_name: str = "",
        lease_seconds: float = 0,
        exclusive: bool = False,
        want_pool_state: bool = False,
        want_engine_state: bool = False,
        profile: str = "",
        num_hash_lookahead_tokens: int = 0,
    ) -> _Coro[pb.AttachResponse]:
        """Hash handshake: a session id and fence. HashMismatchError on a mismatch,
        ProfileMismatchError when the pool follows another ``profile``.
        ``want_pool_state`` (with ``exclusive``): the answer carries the pool's state
        (with ``want_engine_state``, the engine's own state, for a mirror)."""
        return self._unary(
            _ATTACH,
            rq.attach(
                pool,
                hash_algo,
                hash_block_size,
                hash_seed,
                client_name,
                lease_seconds,
                exclusive,
                want_pool_state,
                want_engine_state,
                profile,
                num_hash_lookahead_tokens,
            ),
        )

    def heartbeat(self, session_id: str, fence: pb.Fence | None = None) -> _Coro[pb.HeartbeatResponse]:
        """Renew a session lease; SessionExpiredError / FencedError when lost."""
        return self._unary(_HEARTBEAT, pb.HeartbeatRequest(session_id=session_id, fence=fence))

    def detach(self, session_id: str, fence: pb.Fence | None = None) -> _Coro[pb.DetachResponse]:
        return self._unary(_DETACH, pb.DetachRequest(session_id=session_id, fence=fence))

    def find_longest_cache_hit(
        self, pool: str, block_hashes: Sequence[bytes], num_tokens: int
    ) -> _Coro[pb.FindLongestCacheHitResponse]:
        """Read-only longest hit for these hashes; changes nothing."""
        return self._unary(_FIND_LONGEST_CACHE_HIT, rq.find_longest_cache_hit(pool, block_hashes, num_tokens))

    def allocate(
        self, pool: str, op: pb.AllocateOp, session_id: str, fence: pb.Fence | None = None
    ) -> _Coro[pb.AllocateResponse]:
        """allocate_slots (``result.refused`` when out of blocks)."""
        return self._unary(_ALLOCATE, rq.allocate(pool, op, session_id, fence))

    def free(
        self,
        pool: str,
        request_ids: Iterable[str],
        preempt: bool = False,
        session_id: str = "",
        fence: pb.Fence | None = None,
    ) -> _Coro[pb.FreeResponse]:
        return self._unary(_FREE, rq.free(pool, request_ids, preempt, session_id, fence))

    def step(
        self,
        pool: str,
        ops: Sequence[pb.Operation],
        session_id: str,
        fence: pb.Fence | None = None,
        include_state: bool = False,
    ) -> _Coro[pb.StepResponse]:
        """Apply ``ops`` in order in one round trip: one result each (and the session's
        new events and statistics with ``include_state``)."""
        return self._unary(_STEP, rq.step(pool, ops, session_id, fence, include_state))

    def reset_prefix_cache(
        self, pool: str, session_id: str = "", fence: pb.Fence | None = None
    ) -> _Coro[pb.ResetPrefixCacheResponse]:
        return self._unary(
            _RESET_PREFIX_CACHE, pb.ResetPrefixCacheRequest(pool=pool, session_id=session_id, fence=fence)
        )

    def get_stats(self, pool: str) -> _Coro[pb.GetStatsResponse]:
        return self._unary(_GET_STATS, pb.GetStatsRequest(pool=pool))

    def inspect_pool(
        self,
        pool: str,
        free_queue_limit: int = 0,
        request_ids: Iterable[str] = (),
        *,
        all_requests: bool = False,
        include_cached_blocks: bool = False,
    ) -> _Coro[pb.InspectPoolResponse]:
        """Block tables, free-queue head and cached blocks, read in one consistent step."""
        return self._unary(
            _INSPECT_POOL,
            rq.inspect_pool(pool, free_queue_limit, request_ids, all_requests, include_cached_blocks),
        )

    def score_pools(
        self,
        num_tokens: int,
        prompts: Sequence[pb.HashedPrompt],
        candidate_pools: Sequence[str] = (),
        include_block_ids: bool = False,
        reserve_seconds: float = 0.0,
    ) -> _Coro[pb.ScorePoolsResponse]:
        """Exact prefix-cache scores of a prompt in many pools, best first (read-only;
        needs observe on each pool). ``prompts``: the prompt hashed once per pool hash
        settings (:func:`kvcoord.client.routing.hash_prompt`); ``candidate_pools``: the
        pools to score (empty: every pool the caller may observe); ``reserve_seconds``:
        hold the best pool's hit that long, until a request of the prompt adopts it."""
        return self._unary(
            _SCORE_POOLS,
            rq.score_pools(num_tokens, prompts, candidate_pools, include_block_ids, reserve_seconds),
        )

    def check_pool(self, pool: str) -> _Coro[pb.CheckPoolResponse]:
        """The pool's invariant violations (none when it is sound); read-only, linear in its size."""
        return self._unary(_CHECK_POOL, pb.CheckPoolRequest(pool=pool))

    def list_sessions(self, pool: str) -> _Coro[pb.ListSessionsResponse]:
        """The pool's live sessions, every tenant's (administer role); read-only."""
        return self._unary(_LIST_SESSIONS, pb.ListSessionsRequest(pool=pool))

    async def watch_events(
        self, pool: str, after_sequence: int = 0, fence: pb.Fence | None = None
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        """Stream KV events after ``after_sequence`` until cancelled or the server stops."""
        stream = self._connection(self.routes.route(pool))[1].WatchEvents(
            pb.WatchEventsRequest(pool=pool, after_sequence=after_sequence, fence=fence),
            metadata=self._metadata,
        )
        try:
            async for item in stream:
                yield item
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            stream.cancel()
