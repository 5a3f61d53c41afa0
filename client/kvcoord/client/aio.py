"""The asyncio client of the kvcoord Allocator service: the methods of
:class:`kvcoord.client.client.KVCoordClient`, each returning a coroutine of its response.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, cast

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from . import _requests as rq
from .api import (
    ALLOCATE,
    ATTACH,
    CHECK_POOL,
    CREATE_POOL,
    DELETE_POOL,
    DETACH,
    FIND_LONGEST_CACHE_HIT,
    FREE,
    GET_POOL,
    GET_STATS,
    HEARTBEAT,
    INSPECT_POOL,
    LIST_POOLS,
    LIST_SESSIONS,
    RESET_PREFIX_CACHE,
    SCORE_POOLS,
    STEP,
    Api,
    Coro,
    Req,
    Resp,
    Rpc,
    merged,
)
from .errors import error_from_rpc
from .retry import Attempts
from .step_pieces import pieces, send_in_pieces_async

__all__ = ["AsyncKVCoordClient"]


class AsyncKVCoordClient(Api):
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
        attempts = Attempts(self.retry, rq.kind_of(rpc, request), self.retry_horizon)
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
            pause = self._pause(attempts, err, pool, address, hops)
            hops = hops + 1 if pause is None else 0  # redirects are followed again after a pause
            if pause is not None:
                await asyncio.sleep(pause)

    async def _unary(self, rpc: Rpc[Req, Resp], request: Req) -> Resp:
        return cast(Resp, await self._call(rpc.name, request))

    def create_pool(self, name: str, config: pb.PoolConfig) -> Coro[pb.CreatePoolResponse]:
        """Create a pool (a no-op when an identical one exists)."""
        return self._unary(CREATE_POOL, pb.CreatePoolRequest(name=name, config=config))

    def get_pool(self, name: str) -> Coro[pb.GetPoolResponse]:
        """The pool ``name``: its configuration and state."""
        return self._unary(GET_POOL, pb.GetPoolRequest(name=name))

    def list_pools(self) -> Coro[pb.ListPoolsResponse]:
        """Every pool, in name order; of a replica set, every replica's (each replica
        lists the pools it serves; one that fails to answer fails the call)."""
        return self._list_pools()

    async def _list_pools(self) -> pb.ListPoolsResponse:
        if len(self.routes.addresses) == 1:
            return await self._unary(LIST_POOLS, pb.ListPoolsRequest())
        answers = []
        for address in list(self.routes.addresses):
            try:
                answer = await self._connection(address)[1].ListPools(
                    pb.ListPoolsRequest(), timeout=self.timeout, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, "ListPools") from None
            answers.append((address, answer))
        return merged(self.routes, answers)

    def delete_pool(self, name: str) -> Coro[pb.DeletePoolResponse]:
        return self._unary(DELETE_POOL, pb.DeletePoolRequest(name=name))

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
    ) -> Coro[pb.AttachResponse]:
        """Hash handshake: a session id and fence. HashMismatchError on a mismatch,
        ProfileMismatchError when the pool follows another ``profile``.
        ``want_pool_state`` (with ``exclusive``): the answer carries the pool's state
        (with ``want_engine_state``, the engine's own state, for a mirror)."""
        return self._unary(
            ATTACH,
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

    def heartbeat(self, session_id: str, fence: pb.Fence | None = None) -> Coro[pb.HeartbeatResponse]:
        """Renew a session lease; SessionExpiredError / FencedError when lost."""
        return self._unary(HEARTBEAT, pb.HeartbeatRequest(session_id=session_id, fence=fence))

    def detach(self, session_id: str, fence: pb.Fence | None = None) -> Coro[pb.DetachResponse]:
        return self._unary(DETACH, pb.DetachRequest(session_id=session_id, fence=fence))

    def find_longest_cache_hit(
        self, pool: str, block_hashes: Sequence[bytes], num_tokens: int
    ) -> Coro[pb.FindLongestCacheHitResponse]:
        """Read-only longest hit for these hashes; changes nothing."""
        return self._unary(FIND_LONGEST_CACHE_HIT, rq.find_longest_cache_hit(pool, block_hashes, num_tokens))

    def allocate(
        self, pool: str, op: pb.AllocateOp, session_id: str, fence: pb.Fence | None = None
    ) -> Coro[pb.AllocateResponse]:
        """allocate_slots (``result.refused`` when out of blocks)."""
        return self._unary(ALLOCATE, rq.allocate(pool, op, session_id, fence))

    def free(
        self,
        pool: str,
        request_ids: Iterable[str],
        preempt: bool = False,
        session_id: str = "",
        fence: pb.Fence | None = None,
    ) -> Coro[pb.FreeResponse]:
        return self._unary(FREE, rq.free(pool, request_ids, preempt, session_id, fence))

    def step(
        self,
        pool: str,
        ops: Sequence[pb.Operation],
        session_id: str,
        fence: pb.Fence | None = None,
        include_state: bool = False,
    ) -> Coro[pb.StepResponse]:
        """Apply ``ops`` in order in one round trip: one result each (and the session's
        new events and statistics with ``include_state``); one larger than
        ``step_piece_bytes`` is sent in pieces (:mod:`kvcoord.client.step_pieces`)."""
        request = rq.step(pool, ops, session_id, fence, include_state)
        parts = pieces(request, self.step_piece_bytes)
        if parts is not None:
            return send_in_pieces_async(request, parts, lambda piece: self._unary(STEP, piece))
        return self._unary(STEP, request)

    def reset_prefix_cache(
        self, pool: str, session_id: str = "", fence: pb.Fence | None = None
    ) -> Coro[pb.ResetPrefixCacheResponse]:
        return self._unary(
            RESET_PREFIX_CACHE, pb.ResetPrefixCacheRequest(pool=pool, session_id=session_id, fence=fence)
        )

    def get_stats(self, pool: str) -> Coro[pb.GetStatsResponse]:
        return self._unary(GET_STATS, pb.GetStatsRequest(pool=pool))

    def inspect_pool(
        self,
        pool: str,
        free_queue_limit: int = 0,
        request_ids: Iterable[str] = (),
        *,
        all_requests: bool = False,
        include_cached_blocks: bool = False,
    ) -> Coro[pb.InspectPoolResponse]:
        """Block tables, free-queue head and cached blocks, read in one consistent step."""
        return self._unary(
            INSPECT_POOL,
            rq.inspect_pool(pool, free_queue_limit, request_ids, all_requests, include_cached_blocks),
        )

    def score_pools(
        self,
        num_tokens: int,
        prompts: Sequence[pb.HashedPrompt],
        candidate_pools: Sequence[str] = (),
        include_block_ids: bool = False,
        reserve_seconds: float = 0.0,
    ) -> Coro[pb.ScorePoolsResponse]:
        """Exact prefix-cache scores of a prompt in many pools, best first (read-only
        without ``reserve_seconds``; needs observe on each pool). ``prompts``: the prompt hashed once per pool hash
        settings (:func:`kvcoord.client.routing.hash_prompt`); ``candidate_pools``: the
        pools to score (empty: every pool the caller may observe); ``reserve_seconds``:
        hold the best pool's hit that long, until a request of the prompt adopts it (a
        reserving call carries an idempotency key: a retry after a lost answer reserves
        nothing again)."""
        return self._unary(
            SCORE_POOLS,
            rq.score_pools(num_tokens, prompts, candidate_pools, include_block_ids, reserve_seconds),
        )

    def check_pool(self, pool: str) -> Coro[pb.CheckPoolResponse]:
        """The pool's invariant violations (none when it is sound); read-only, linear in its size."""
        return self._unary(CHECK_POOL, pb.CheckPoolRequest(pool=pool))

    def list_sessions(self, pool: str) -> Coro[pb.ListSessionsResponse]:
        """The pool's live sessions, every tenant's (administer role); read-only."""
        return self._unary(LIST_SESSIONS, pb.ListSessionsRequest(pool=pool))

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
