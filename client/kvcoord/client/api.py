"""What both clients of the Allocator service share: each unary RPC (its name, message
types and request builder) bound as a method of both, the channel set-up per replica,
one call's attempts (:class:`Call`: routing, retries, calls given up on) and the merge
of several replicas' pool lists.

:mod:`kvcoord.client.client` (blocking) and :mod:`kvcoord.client.aio` (asyncio) each
give the transport (``unary``) and the methods that differ (``list_pools``,
``watch_events``); every other RPC method is one line of :class:`Api`.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, ParamSpec, TypeAlias, TypeVar, overload

import grpc
from google.protobuf.message import Message
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from . import _requests as rq
from . import given_up
from .errors import REPLICA_METADATA_KEY, KVCoordError, WrongReplicaError, error_from_rpc
from .owners import AGAIN, SETTLE, Routes
from .retry import DEFAULT_RETRY, Attempts, RetryPolicy
from .step_pieces import DEFAULT_STEP_PIECE_BYTES, ops_cap
from .tls import TLSOptions

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT",
    "UNARY_METHODS",
    "Api",
    "AsyncApi",
    "BlockingApi",
    "Call",
    "Coro",
    "Rpc",
    "merged",
    "retry_horizon",
]

DEFAULT_TIMEOUT = 10.0
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the server's default max_message_bytes


Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
P = ParamSpec("P")
_T = TypeVar("_T")

#: what the asyncio client's RPC methods return: a coroutine of the response
Coro: TypeAlias = Coroutine[Any, Any, _T]


@dataclasses.dataclass(frozen=True, eq=False)
class Rpc(Generic[P, Req, Resp]):
    """One unary RPC of the Allocator service: its name (the stub's attribute and the key
    of ``_requests.RPCS``), its message types, and the function that builds its request
    from the client method's arguments (whose parameters and docstring the method has).

    As a class attribute of a client it is that method: ``client.get_pool(name)`` sends
    ``build(name)`` through the client's ``unary``, typed with the response (the
    asyncio client's, a coroutine of it)."""

    name: str
    request: type[Req]
    response: type[Resp]
    build: Callable[P, Req]
    #: the method's function (made once): its first argument is the client
    function: Callable[..., Any] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        rpc, build = self, self.build

        def function(client: Any, /, *args: Any, **kwargs: Any) -> Any:
            return client.unary(rpc, build(*args, **kwargs))

        function.__name__ = function.__qualname__ = build.__name__
        function.__doc__ = build.__doc__
        params = inspect.signature(build).parameters.values()
        function.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("client", inspect.Parameter.POSITIONAL_ONLY), *params]
        )
        object.__setattr__(self, "function", function)

    @overload
    def __get__(self, client: None, owner: type | None = None) -> Rpc[P, Req, Resp]: ...
    @overload
    def __get__(self, client: AsyncApi, owner: type | None = None) -> Callable[P, Coro[Resp]]: ...
    @overload
    def __get__(self, client: BlockingApi, owner: type | None = None) -> Callable[P, Resp]: ...
    def __get__(self, client: Any, owner: type | None = None) -> Any:
        return self if client is None else types.MethodType(self.function, client)


#: the RPC whose method each client writes itself (a merge of replicas' lists)
LIST_POOLS = Rpc("ListPools", pb.ListPoolsRequest, pb.ListPoolsResponse, rq.list_pools)


def merged(routes: Routes, answers: Sequence[tuple[str, pb.ListPoolsResponse]]) -> pb.ListPoolsResponse:
    """Several replicas' pool lists as one, in name order (a pool two replicas list
    while it moves: the first listing); each pool's owner is remembered."""
    pools: dict[str, pb.PoolInfo] = {}
    for address, answer in answers:
        for info in answer.pools:
            if info.name not in pools:
                pools[info.name] = info
                routes.listed(info.name, address, info.replica_name)
    return pb.ListPoolsResponse(pools=[pools[n] for n in sorted(pools)])


class Api:
    """The RPC methods and channel set-up shared by both clients. Each RPC method below
    builds its request with ``_requests`` and sends it through the client's ``unary``
    (:class:`Rpc`), typed by whether the client is a :class:`BlockingApi` or an
    :class:`AsyncApi`."""

    create_pool = Rpc("CreatePool", pb.CreatePoolRequest, pb.CreatePoolResponse, rq.create_pool)
    get_pool = Rpc("GetPool", pb.GetPoolRequest, pb.GetPoolResponse, rq.get_pool)
    delete_pool = Rpc("DeletePool", pb.DeletePoolRequest, pb.DeletePoolResponse, rq.delete_pool)
    attach = Rpc("Attach", pb.AttachRequest, pb.AttachResponse, rq.attach)
    heartbeat = Rpc("Heartbeat", pb.HeartbeatRequest, pb.HeartbeatResponse, rq.heartbeat)
    detach = Rpc("Detach", pb.DetachRequest, pb.DetachResponse, rq.detach)
    find_longest_cache_hit = Rpc(
        "FindLongestCacheHit",
        pb.FindLongestCacheHitRequest,
        pb.FindLongestCacheHitResponse,
        rq.find_longest_cache_hit,
    )
    allocate = Rpc("Allocate", pb.AllocateRequest, pb.AllocateResponse, rq.allocate)
    free = Rpc("Free", pb.FreeRequest, pb.FreeResponse, rq.free)
    #: (a Step larger than ``step_piece_bytes`` is sent in pieces: each client's ``unary``)
    step = Rpc("Step", pb.StepRequest, pb.StepResponse, rq.step)
    reset_prefix_cache = Rpc(
        "ResetPrefixCache", pb.ResetPrefixCacheRequest, pb.ResetPrefixCacheResponse, rq.reset_prefix_cache
    )
    get_stats = Rpc("GetStats", pb.GetStatsRequest, pb.GetStatsResponse, rq.get_stats)
    inspect_pool = Rpc("InspectPool", pb.InspectPoolRequest, pb.InspectPoolResponse, rq.inspect_pool)
    check_pool = Rpc("CheckPool", pb.CheckPoolRequest, pb.CheckPoolResponse, rq.check_pool)
    score_pools = Rpc("ScorePools", pb.ScorePoolsRequest, pb.ScorePoolsResponse, rq.score_pools)
    list_sessions = Rpc("ListSessions", pb.ListSessionsRequest, pb.ListSessionsResponse, rq.list_sessions)

    #: a Step of more operations than this is sent in pieces too (0: never): the
    #: server's max_ops_per_step, learned at attach (AttachResponse.max_ops_per_step)
    step_piece_ops: int = 0
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
        step_piece_bytes: int = DEFAULT_STEP_PIECE_BYTES,
        cluster: str = "",
    ) -> None:
        """Open a channel to ``target`` (``host:port`` or ``unix:/path``), or to a
        replica set: a list of addresses (or one string of them, comma-separated), or
        a DNS name whose A records are the replicas (a headless Service). Each pool's
        calls go to its owner: a NOT_OWNER answer names it and is followed (at most
        :data:`~kvcoord.client.owners.MAX_HOPS` times per call), and an owner that
        does not answer is forgotten and tried after the live replicas until it
        answers; while the set changes hands the client pauses briefly instead of
        backing off (``owners.Routes.failed``, ``retry.Attempts``).

        Args:
            timeout: deadline of each attempt, in seconds.
            retry: retry settings for calls that are safe to repeat.
            max_message_bytes: send/receive limit (match the server's for large Steps).
            token: bearer token, when the server sets ``auth_tokens``.
            interceptors: gRPC client interceptors for the channel (e.g. FaultInjector;
                the asyncio client's: ``grpc.aio`` ones, e.g. faults_aio.AsyncFaultInjector).
            tls: connect over TLS (mutual TLS with a client certificate); ``None`` is plaintext.
            step_piece_bytes: a Step serialized larger than this is sent as several
                Steps of whole operations, answered as one (:mod:`kvcoord.client.step_pieces`;
                0: never split).
            cluster: the name of the cluster the replica set is (its ``[cluster] name``;
                "": not checked): every call to an address no redirect or answer has named
                a replica for names the cluster (``kvcoord-replica: <cluster>/*``), so a
                server of another cluster, or of none, refuses it (WRONG_REPLICA) even
                before the client's first answer from that address.

        Raises:
            ValueError: a TLS file is unreadable or invalid (named in the message), or
                ``cluster`` is not printable ASCII without '/' or spaces.
        """
        if cluster and not all("!" <= ch <= "~" and ch != "/" for ch in cluster):
            raise ValueError(f"cluster must be printable ASCII without '/' or spaces, got {cluster!r}")
        #: what a call to an address naming no replica names: any replica of the cluster
        self._any_replica = f"{cluster}/*" if cluster else ""
        #: the replica set and each pool's owner as last learned (owners.py)
        self.routes = Routes(target)
        self.target = target if isinstance(target, str) else ",".join(target)
        self.timeout = timeout
        #: a Step larger than this is sent in pieces (step_pieces.py; 0: never)
        self.step_piece_bytes = step_piece_bytes
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

    def _metadata_at(self, address: str) -> Any:
        """The metadata of a call to ``address``: the token, and the replica named there
        (a redirect's, an answer's; else any replica of the ``cluster`` given) in
        ``kvcoord-replica``: any other server refuses the call, WRONG_REPLICA, so an
        address the replica left is never taken for it."""
        named = self.routes.named.get(address) or self._any_replica
        if not named:
            return self._metadata
        return (*(self._metadata or ()), (REPLICA_METADATA_KEY, named))

    def _listed_at(self, address: str) -> Any:
        """ListPools of one replica (the asyncio client's: an awaitable of the answer)."""
        return self._connection(address)[1].ListPools(
            pb.ListPoolsRequest(), timeout=self.timeout, metadata=self._metadata_at(address)
        )

    def _watch(self, pool: str, after_sequence: int, fence: pb.Fence | None, **kw: Any) -> tuple[str, Any]:
        """The address of ``pool``'s owner and its WatchEvents stream there (``kw``: the
        call's timeout)."""
        request = pb.WatchEventsRequest(pool=pool, after_sequence=after_sequence, fence=fence)
        address = self.routes.route(pool)
        return address, self._connection(address)[1].WatchEvents(
            request, metadata=self._metadata_at(address), **kw
        )

    def _watch_failed(self, exc: grpc.RpcError, pool: str, address: str) -> KVCoordError:
        """A watch's error, naming ``address``; a WRONG_REPLICA refusal is told to the
        routes (the next watch goes elsewhere) as a call's is."""
        err = error_from_rpc(exc, "WatchEvents")
        err.address = address
        if isinstance(err, WrongReplicaError):
            self.routes.wrong_replica(pool, address)
        return err

    def _listing_refused(self, exc: grpc.RpcError, address: str, again: bool) -> KVCoordError | None:
        """ListPools at ``address`` failed: its error (naming the address), or None when
        it refused the call as meant for another replica: the routes are told (its name
        there becomes its cluster's, ``<cluster>/*``), and the listing asks it ``again``
        once, else leaves it out (no replica of the set)."""
        err = error_from_rpc(exc, "ListPools")
        err.address = address
        if not isinstance(err, WrongReplicaError):
            return err
        if again:
            self.routes.wrong_replica("", address)
        return None

    def _learn(self, rpc: str, response: Any) -> None:
        """What any Attach answer tells the asyncio client, however the Attach was made:
        the server's max_ops_per_step (``step_piece_ops``,
        :func:`~kvcoord.client.step_pieces.ops_cap`) and its idempotency window
        (``retry_horizon``: a keyed call is retried no longer than the server keeps its
        answer; the blocking client learns that through its session keeper)."""
        if (cap := ops_cap(rpc, response)) is not None:
            self.step_piece_ops = cap
            self.retry_horizon = retry_horizon(response)

    @staticmethod
    def _intercepted(channel: Any, interceptors: Sequence[Any]) -> Any:
        return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


class Call:
    """One call's attempts, as both clients make them (each only sends them, and
    sleeps): where each attempt goes (its pool's owner), what an answer teaches the
    routes and the record of calls given up on, and what follows a failure.

    Args:
        api: the client.
        rpc, request: the call (``request`` names its session's calls given up on
            now: :func:`~kvcoord.client.given_up.name_on`).
    """

    def __init__(self, api: Api, rpc: str, request: Any) -> None:
        self.routes, self.rpc, self.request = api.routes, rpc, request
        self.pool = api.routes.pool_of(rpc, request)
        self.attempts = Attempts(api.retry, rq.kind_of(rpc, request), api.retry_horizon)
        #: redirects followed in a row (reset by a pause)
        self.hops = 0
        self.named = given_up.name_on(rpc, request)
        self.address = ""

    def route(self) -> str:
        """The address of the next attempt."""
        self.address = self.routes.route(self.pool)
        return self.address

    def answered(self, response: Any) -> Any:
        """The attempt was answered: ``response``, remembered by the routes."""
        self.routes.answered(self.rpc, self.request, response, self.pool, self.address)
        given_up.answered(self.rpc, self.request, self.named)
        return response

    def failed(self, err: KVCoordError) -> float | None:
        """The attempt failed with ``err``: None to call again at once (a redirect to
        follow, another replica to ask), else the seconds to wait first (the routes
        decide whether the replica set is changing hands; the policy bounds the wait).

        Raises:
            KVCoordError: the call's final error (remembered as given up on when its
                outcome is unknown).
        """
        attempts = self.attempts
        err.address = self.address
        try:
            attempts.note(err)
            step = self.routes.failed(err, self.pool, self.address, self.hops, attempts.kind)
            pause = None if step == AGAIN else attempts.next_sleep(err, changing=step == SETTLE)
        except KVCoordError as final:  # (OutcomeUnknownError: a new error, named here too)
            final.address = final.address or self.address
            given_up.failed(self.rpc, self.request, final)
            raise
        self.hops = self.hops + 1 if pause is None else 0  # redirects are followed again after a pause
        return pause


def retry_horizon(attached: pb.AttachResponse) -> float:
    """How long keyed calls may be retried after this Attach answer: half the server's
    idempotency window (a retry must reach it while it still keeps the answer), at
    least 1 s."""
    return max(1.0, float(attached.idempotency_window_seconds) / 2)


class BlockingApi(Api):
    """An :class:`Api` whose RPC methods return the response (:class:`KVCoordClient`)."""


class AsyncApi(Api):
    """An :class:`Api` whose RPC methods return a coroutine of the response
    (:class:`AsyncKVCoordClient`)."""


#: every unary RPC the clients call, with the method that calls it (tests check this
#: against the service descriptor, ``_requests.RPCS`` and both clients' methods)
UNARY_METHODS: dict[str, Rpc[Any, Any, Any]] = {
    **{name: rpc for name, rpc in vars(Api).items() if isinstance(rpc, Rpc)},
    "list_pools": LIST_POOLS,
}
