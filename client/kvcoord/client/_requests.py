"""Request builders shared by the sync and asyncio clients (one place, two transports)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import block_ids_to_pb

#: rpc name -> how a failure whose outcome is unknown (UNAVAILABLE, DEADLINE_EXCEEDED)
#: is handled: "read" (no effect: retry), "keyed" (retry with the same idempotency
#: key: applied at most once), "attach" (retry with the same attach_key: the server
#: answers with the session a lost answer named), "once" (never retried:
#: OutcomeUnknownError).
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


def allocate_op(
    sync: pb.RequestSync | None,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Sequence[Sequence[int]] | None = None,
    num_lookahead_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
    lookup: bool = False,
    into: pb.AllocateOp | None = None,
) -> pb.AllocateOp:
    """allocate_slots' arguments as an AllocateOp carrying a copy of ``sync`` (an empty
    hit is sent as none); written into ``into`` when given, whose request sync the
    caller fills in place (``sync`` is then ``None``: a long prompt is not copied)."""
    op = pb.AllocateOp() if into is None else into
    if sync is not None:
        op.request.CopyFrom(sync)
    op.num_new_tokens = num_new_tokens
    op.num_new_computed_tokens = num_new_computed_tokens
    op.num_lookahead_tokens = num_lookahead_tokens
    op.num_external_computed_tokens = num_external_computed_tokens
    op.delay_cache_blocks = delay_cache_blocks
    op.num_encoder_tokens = num_encoder_tokens
    op.lookup = lookup
    if new_computed_blocks is not None and any(new_computed_blocks):
        op.new_computed_blocks.groups.extend(block_ids_to_pb(new_computed_blocks))
        op.new_computed_blocks.num_tokens = num_new_computed_tokens
    return op


def allocate(pool: str, op: pb.AllocateOp, session_id: str, fence: pb.Fence | None) -> pb.AllocateRequest:
    return pb.AllocateRequest(pool=pool, session_id=session_id, op=op, idempotency_key=key(), fence=fence)


def free(
    pool: str, request_ids: Iterable[str], preempt: bool, session_id: str, fence: pb.Fence | None
) -> pb.FreeRequest:
    return pb.FreeRequest(
        pool=pool,
        session_id=session_id,
        request_ids=list(request_ids),
        preempt=preempt,
        idempotency_key=key(),
        fence=fence,
    )


def step(
    pool: str,
    ops: Sequence[pb.Operation],
    session_id: str,
    fence: pb.Fence | None,
    include_state: bool = False,
) -> pb.StepRequest:
    return pb.StepRequest(
        pool=pool,
        session_id=session_id,
        ops=list(ops),
        idempotency_key=key(),
        fence=fence,
        include_state=include_state,
    )


def attach(
    pool: str,
    hash_algo: str,
    hash_block_size: int,
    hash_seed: str,
    client_name: str,
    lease_seconds: float,
    exclusive: bool = False,
    want_pool_state: bool = False,
    want_engine_state: bool = False,
    profile: str = "",
    num_hash_lookahead_tokens: int = 0,
) -> pb.AttachRequest:
    return pb.AttachRequest(
        attach_key=key(),  # its retries carry it: a lost answer leaves no second session
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


def find_longest_cache_hit(
    pool: str, block_hashes: Sequence[bytes], num_tokens: int
) -> pb.FindLongestCacheHitRequest:
    return pb.FindLongestCacheHitRequest(pool=pool, block_hashes=list(block_hashes), num_tokens=num_tokens)


def score_pools(
    num_tokens: int,
    prompts: Iterable[pb.HashedPrompt],
    candidate_pools: Iterable[str],
    include_block_ids: bool,
    reserve_seconds: float,
) -> pb.ScorePoolsRequest:
    """A reserving call (``reserve_seconds > 0``) carries an idempotency key: a retry
    after a lost answer is answered from the first call and reserves nothing again."""
    return pb.ScorePoolsRequest(
        num_tokens=num_tokens,
        prompts=list(prompts),
        candidate_pools=list(candidate_pools),
        include_block_ids=include_block_ids,
        reserve_seconds=reserve_seconds,
        idempotency_key=key() if reserve_seconds > 0 else "",
    )


def inspect_pool(
    pool: str,
    free_queue_limit: int,
    request_ids: Iterable[str],
    all_requests: bool,
    include_cached_blocks: bool,
) -> pb.InspectPoolRequest:
    return pb.InspectPoolRequest(
        pool=pool,
        free_queue_limit=free_queue_limit,
        request_ids=list(request_ids),
        all_requests=all_requests,
        include_cached_blocks=include_cached_blocks,
    )


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
