"""Request builders shared by the sync and asyncio clients (one place, two transports).

Each builder's parameters and docstring are those of the clients' method of the same
name (``api.Api`` binds them: ``client.get_pool(name)`` sends ``get_pool(name)``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb

#: rpc name -> how a failure whose outcome is unknown (UNAVAILABLE, DEADLINE_EXCEEDED,
#: CANCELLED) is handled: "read" (no effect: retry), "keyed" (retry with the same idempotency
#: key: applied at most once), "attach" (retry with the same attach_key: the server
#: answers with the session a lost answer named), "once" (never retried:
#: OutcomeUnknownError; only an attempt never sent, no connection made, is repeated).
RPCS: dict[str, str] = {
    "CreatePool": "read",  # creating an identical pool again is a no-op
    "GetPool": "read",
    "ListPools": "read",
    "DeletePool": "once",
    "Attach": "attach",
    "Heartbeat": "read",
    "Detach": "once",
    "FindLongestCacheHit": "read",
    "Allocate": "keyed",
    "Free": "keyed",
    "Step": "keyed",
    "ResetPrefixCache": "once",
    "GetStats": "read",
    "InspectPool": "read",
    "CheckPool": "read",
    "ScorePools": "read",  # a reserving one is "keyed": kind_of()
    "ListSessions": "read",
}


def kind_of(rpc: str, request: object) -> str:
    """How a failure of this call whose outcome is unknown is handled (:data:`RPCS`):
    a ScorePools that reserves (``reserve_seconds > 0``) is a mutation sent with an
    idempotency key, "keyed"; every other call, its RPC's kind."""
    if rpc == "ScorePools" and getattr(request, "reserve_seconds", 0) > 0:
        return "keyed"
    return RPCS[rpc]


def key() -> str:
    return uuid.uuid4().hex


def keyed(rpc: str, request: Any) -> None:
    """Before a call's first attempt: a keyed one (:func:`kind_of`) its caller built
    without an idempotency key gets one, and a ``call_sequence`` unless it has one
    (written in place). Unkeyed, its retry after a lost answer would be a new call,
    applied again (an Allocate registering its request twice, a Free told the request
    it freed is unknown: a "nothing applied" answer while the first attempt was). A
    request its caller keyed is sent as it is."""
    if kind_of(rpc, request) != "keyed" or request.idempotency_key:
        return
    request.idempotency_key = key()
    if "call_sequence" in request.DESCRIPTOR.fields_by_name and not request.call_sequence:
        request.call_sequence = sequence()


_sequence_lock = threading.Lock()
_last_sequence = 0


def sequence() -> int:
    """A keyed call's ``call_sequence``: strictly increasing across the whole process
    (so within each session, in the order its calls are built), from the wall clock in
    nanoseconds (several processes sharing a session stay in order unless their clocks
    differ by more than the server's idempotency window), never lower than the last one
    given, whatever the clock does. A call keeps its number on every retry."""
    global _last_sequence
    with _sequence_lock:
        _last_sequence = max(_last_sequence + 1, time.time_ns())
        return _last_sequence


def create_pool(name: str, config: pb.PoolConfig) -> pb.CreatePoolRequest:
    """Create a pool (a no-op when an identical one exists)."""
    return pb.CreatePoolRequest(name=name, config=config)


def get_pool(name: str) -> pb.GetPoolRequest:
    """The pool ``name``: its configuration and state."""
    return pb.GetPoolRequest(name=name)


def list_pools() -> pb.ListPoolsRequest:
    return pb.ListPoolsRequest()


def delete_pool(
    name: str, force: bool = False, session_id: str = "", incarnation: int = 0
) -> pb.DeletePoolRequest:
    """Delete the pool ``name`` (retried only when never sent: an unknown outcome is OutcomeUnknownError).
    While an exclusive session holds it, PoolBusyError (POOL_EXCLUSIVE, naming the
    session) unless ``force`` or the call names that session (``session_id``): its
    worker may be running on its own copy of the pool. ``incarnation`` (0: any; else
    ``PoolInfo.fence.incarnation`` as create_pool or get_pool told it): only that
    incarnation is deleted, another is FencedError (INCARNATION_CHANGED), nothing
    deleted; name it to delete again after OutcomeUnknownError without deleting a
    pool made again meanwhile."""
    return pb.DeletePoolRequest(name=name, force=force, session_id=session_id, incarnation=incarnation)


def attach(
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
    reset_prefix_cache: bool = False,
    attach_key: str = "",
    previous_fence: pb.Fence | None = None,
) -> pb.AttachRequest:
    """Hash handshake: a session id and fence. HashMismatchError on a mismatch,
    ProfileMismatchError when the pool follows another ``profile``.
    ``want_pool_state`` (with ``exclusive``): the answer carries the pool's state
    (with ``want_engine_state``, the engine's own state, for a mirror).
    ``reset_prefix_cache``: the pool's prefix cache is reset as the session starts (the
    caller's KV memory holds none of it; routers' reservations are released); PoolBusyError
    while another session is attached. ``attach_key``: the Attach's retry key (a new one
    when empty); the call's own retries carry it, and so may a later call sending the
    same Attach again after every answer of this one was lost. ``previous_fence``: the
    fence of the session this client held before (attaching again after losing it):
    a restored server it proves behind fences everyone first (FencedError)."""
    return pb.AttachRequest(
        previous_fence=previous_fence,
        reset_prefix_cache=reset_prefix_cache,
        attach_key=attach_key or key(),  # its retries carry it: a lost answer leaves no second session
        profile=profile,
        num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        want_pool_state=want_pool_state,
        want_engine_state=want_engine_state,
        pool=pool,
        hash_algo=hash_algo,
        hash_block_size=hash_block_size,
        hash_seed=hash_seed,
        client_name=client_name,
        lease_seconds=lease_seconds,
        exclusive=exclusive,
    )


def heartbeat(session_id: str, fence: pb.Fence | None = None, pool: str = "") -> pb.HeartbeatRequest:
    """Renew a session lease; SessionExpiredError / FencedError when lost. ``pool``: the
    session's (by default the one its Attach through this client named)."""
    return pb.HeartbeatRequest(session_id=session_id, fence=fence, pool=pool)


def detach(session_id: str, fence: pb.Fence | None = None, pool: str = "") -> pb.DetachRequest:
    """End a session: the server frees every request it owned. ``pool``: as heartbeat's."""
    return pb.DetachRequest(session_id=session_id, fence=fence, pool=pool)


def find_longest_cache_hit(
    pool: str, block_hashes: Sequence[bytes], num_tokens: int
) -> pb.FindLongestCacheHitRequest:
    """Read-only longest hit for these hashes; changes nothing."""
    return pb.FindLongestCacheHitRequest(pool=pool, block_hashes=list(block_hashes), num_tokens=num_tokens)


def allocate(
    pool: str, op: pb.AllocateOp, session_id: str, fence: pb.Fence | None = None
) -> pb.AllocateRequest:
    """allocate_slots (``result.refused`` when out of blocks)."""
    return pb.AllocateRequest(
        pool=pool, session_id=session_id, op=op, idempotency_key=key(), fence=fence, call_sequence=sequence()
    )


def free(
    pool: str,
    request_ids: Iterable[str],
    preempt: bool = False,
    session_id: str = "",
    fence: pb.Fence | None = None,
) -> pb.FreeRequest:
    """Free (or, with ``preempt``, preempt) these requests' blocks."""
    return pb.FreeRequest(
        pool=pool,
        session_id=session_id,
        request_ids=list(request_ids),
        preempt=preempt,
        idempotency_key=key(),
        fence=fence,
        call_sequence=sequence(),
    )


def step(
    pool: str,
    ops: Sequence[pb.Operation],
    session_id: str,
    fence: pb.Fence | None = None,
    include_state: bool = False,
) -> pb.StepRequest:
    """Apply ``ops`` in order in one round trip: one result each (and the session's
    new events and statistics with ``include_state``); one larger than
    ``step_piece_bytes`` is sent in pieces (:mod:`kvcoord.client.step_pieces`)."""
    return pb.StepRequest(
        pool=pool,
        session_id=session_id,
        ops=list(ops),
        idempotency_key=key(),
        fence=fence,
        include_state=include_state,
        call_sequence=sequence(),
    )


def reset_prefix_cache(
    pool: str, session_id: str = "", fence: pb.Fence | None = None
) -> pb.ResetPrefixCacheRequest:
    """vLLM's reset_prefix_cache on the pool (retried only when never sent)."""
    return pb.ResetPrefixCacheRequest(pool=pool, session_id=session_id, fence=fence)


def get_stats(pool: str) -> pb.GetStatsRequest:
    """The pool's counters, prefix-cache statistics and the server's limits."""
    return pb.GetStatsRequest(pool=pool)


def inspect_pool(
    pool: str,
    free_queue_limit: int = 0,
    request_ids: Iterable[str] = (),
    *,
    all_requests: bool = False,
    include_cached_blocks: bool = False,
) -> pb.InspectPoolRequest:
    """Block tables, free-queue head and cached blocks, read in one consistent step."""
    return pb.InspectPoolRequest(
        pool=pool,
        free_queue_limit=free_queue_limit,
        request_ids=list(request_ids),
        all_requests=all_requests,
        include_cached_blocks=include_cached_blocks,
    )


def score_pools(
    num_tokens: int,
    prompts: Sequence[pb.HashedPrompt],
    candidate_pools: Sequence[str] = (),
    include_block_ids: bool = False,
    reserve_seconds: float = 0.0,
) -> pb.ScorePoolsRequest:
    """Exact prefix-cache scores of a prompt in many pools, best first (read-only
    without ``reserve_seconds``; needs observe on each pool). ``prompts``: the prompt hashed once per pool hash
    settings (:func:`kvcoord.client.routing.hash_prompt`); ``candidate_pools``: the
    pools to score (empty: every pool the caller may observe); ``reserve_seconds``:
    hold the best pool's hit that long, until a request of the prompt adopts it (a
    reserving call carries an idempotency key: a retry after a lost answer reserves
    nothing again)."""
    return pb.ScorePoolsRequest(
        num_tokens=num_tokens,
        prompts=list(prompts),
        candidate_pools=list(candidate_pools),
        include_block_ids=include_block_ids,
        reserve_seconds=reserve_seconds,
        idempotency_key=key() if reserve_seconds > 0 else "",
    )


def check_pool(pool: str) -> pb.CheckPoolRequest:
    """The pool's invariant violations (none when it is sound); read-only, linear in its size."""
    return pb.CheckPoolRequest(pool=pool)


def list_sessions(pool: str) -> pb.ListSessionsRequest:
    """The pool's live sessions, every tenant's (administer role); read-only."""
    return pb.ListSessionsRequest(pool=pool)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # find a restarted server within a second (gRPC's default backoff grows to minutes)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    ]
