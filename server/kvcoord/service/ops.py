"""Pool operations on the wire: request sync, then one engine call, then its result.

Used by Step (many operations) and by the unary RPCs (one). No allocation policy
lives here: every decision is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from kvcoord.engine import RequestCheckpoint, StaleCacheHitError
from kvcoord.v1 import allocator_pb2 as pb

from .convert import block_ids_to_pb, hit_from_pb, hit_to_pb, lora_from_pb, stats_to_pb
from .errors import ServiceError
from .registry import PoolHandle

__all__ = ["apply_operation", "sync_request"]

Undo = Callable[[], None]


def _check_owner(handle: PoolHandle, session_id: str, request_id: str) -> None:
    owner = handle.owners.get(request_id)
    if owner is not None and owner != session_id:
        raise ServiceError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"request {request_id!r} belongs to another session of pool {handle.name!r}",
        )


def _request_id(value: str) -> str:
    if not value:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
    return value


def sync_request(handle: PoolHandle, session_id: str, sync: pb.RequestSync) -> tuple[str, Undo]:
    """Register or update a request from its sync message; return its id and an undo."""
    rid = _request_id(sync.request_id)
    _check_owner(handle, session_id, rid)
    engine = handle.engine
    checkpoint: RequestCheckpoint | None = engine.checkpoint_request(rid)
    computed = sync.num_computed_tokens if sync.HasField("num_computed_tokens") else None
    if checkpoint is None:
        if len(engine.requests) >= handle.limits.max_requests_per_pool:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"pool {handle.name!r} already tracks {len(engine.requests)} requests (max_requests_per_pool)",
            )
        engine.add_request(
            rid,
            list(sync.append_token_ids),
            list(sync.append_block_hashes),
            lora=lora_from_pb(sync.lora),
            skip_reading_prefix_cache=sync.skip_reading_prefix_cache,
            num_preemptions=sync.num_preemptions,
        )
        if computed is not None:
            try:
                engine.update_request(rid, num_computed_tokens=computed)
            except Exception:
                engine.restore_request(rid, None)
                raise
        if session_id:
            handle.owners[rid] = session_id
    elif sync.append_token_ids or sync.append_block_hashes or computed is not None:
        engine.update_request(
            rid,
            num_computed_tokens=computed,
            append_token_ids=list(sync.append_token_ids),
            append_block_hashes=list(sync.append_block_hashes),
        )

    def undo() -> None:
        engine.restore_request(rid, checkpoint)
        if checkpoint is None:
            handle.owners.pop(rid, None)

    return rid, undo


def _with_sync(
    handle: PoolHandle, session_id: str, sync: pb.RequestSync, call: Callable[[str], pb.OperationResult]
) -> pb.OperationResult:
    rid, undo = sync_request(handle, session_id, sync)
    try:
        return call(rid)
    except Exception:
        undo()
        raise


def _lookup(h: PoolHandle, s: str, op: pb.LookupOp) -> pb.OperationResult:
    return _with_sync(
        h,
        s,
        op.request,
        lambda rid: pb.OperationResult(
            lookup=pb.LookupResult(hit=hit_to_pb(h.engine.get_computed_blocks(rid)))
        ),
    )


def _allocate(h: PoolHandle, s: str, op: pb.AllocateOp) -> pb.OperationResult:
    engine = h.engine

    def call(rid: str) -> pb.OperationResult:
        if op.lookup:
            res = engine.allocate_slots_with_lookup(
                rid,
                op.num_new_tokens,
                op.num_lookahead_tokens,
                op.num_external_computed_tokens,
                op.delay_cache_blocks,
                op.num_encoder_tokens,
            )
            out = pb.AllocateResult(
                refused=res.new_block_ids is None, hit=hit_to_pb(res.hit), num_new_tokens=res.num_new_tokens
            )
            if res.new_block_ids is not None:
                out.new_block_ids.extend(block_ids_to_pb(res.new_block_ids))
            return pb.OperationResult(allocate=out)
        try:
            new = engine.allocate_slots(
                rid,
                op.num_new_tokens,
                op.num_new_computed_tokens,
                hit_from_pb(op.new_computed_blocks, len(h.config.groups)),
                op.num_lookahead_tokens,
                op.num_external_computed_tokens,
                op.delay_cache_blocks,
                op.num_encoder_tokens,
            )
        except StaleCacheHitError:
            # A concurrency conflict, not bad input: reported as an outcome (nothing changed).
            return pb.OperationResult(allocate=pb.AllocateResult(stale_hit=True))
        result = pb.AllocateResult(refused=new is None, num_new_tokens=op.num_new_tokens)
        if new is not None:
            result.new_block_ids.extend(block_ids_to_pb(new))
        return pb.OperationResult(allocate=result)

    return _with_sync(h, s, op.request, call)


def _free(h: PoolHandle, s: str, op: pb.FreeOp) -> pb.OperationResult:
    rid = _request_id(op.request_id)
    _check_owner(h, s, rid)
    h.engine.free(rid)
    h.owners.pop(rid, None)
    return pb.OperationResult()


def _preempt(h: PoolHandle, s: str, op: pb.PreemptOp) -> pb.OperationResult:
    rid = _request_id(op.request_id)
    _check_owner(h, s, rid)
    h.engine.preempt(rid)
    return pb.OperationResult()


def _cache_blocks(h: PoolHandle, s: str, op: pb.CacheBlocksOp) -> pb.OperationResult:
    def call(rid: str) -> pb.OperationResult:
        h.engine.cache_blocks(rid, op.num_computed_tokens)
        return pb.OperationResult()

    return _with_sync(h, s, op.request, call)


def _remove_skipped(h: PoolHandle, s: str, op: pb.RemoveSkippedBlocksOp) -> pb.OperationResult:
    def call(rid: str) -> pb.OperationResult:
        h.engine.remove_skipped_blocks(rid, op.total_computed_tokens)
        return pb.OperationResult()

    return _with_sync(h, s, op.request, call)


def _evict(h: PoolHandle, s: str, op: pb.EvictBlocksOp) -> pb.OperationResult:
    h.engine.evict_blocks(list(op.block_ids))
    return pb.OperationResult()


def _get_block_ids(h: PoolHandle, s: str, op: pb.GetBlockIdsOp) -> pb.OperationResult:
    rid = _request_id(op.request_id)
    ids = h.engine.get_block_ids(rid)
    return pb.OperationResult(get_block_ids=pb.GetBlockIdsResult(groups=block_ids_to_pb(ids)))


def _common_prefix(h: PoolHandle, s: str, op: pb.CommonPrefixOp) -> pb.OperationResult:
    rid = _request_id(op.request_id)
    n = h.engine.get_num_common_prefix_blocks(rid)
    return pb.OperationResult(common_prefix=pb.CommonPrefixResult(num_blocks=list(n)))


def _reset(h: PoolHandle, s: str, op: pb.ResetPrefixCacheOp) -> pb.OperationResult:
    return pb.OperationResult(
        reset_prefix_cache=pb.ResetPrefixCacheResult(result=h.engine.reset_prefix_cache())
    )


def _take_events(h: PoolHandle, s: str, op: pb.TakeEventsOp) -> pb.OperationResult:
    h.publish_events()
    return pb.OperationResult(take_events=pb.TakeEventsResult(events=h.events.take()))


def _make_stats(h: PoolHandle, s: str, op: pb.MakePrefixCacheStatsOp) -> pb.OperationResult:
    stats = stats_to_pb(h.engine.make_prefix_cache_stats())
    return pb.OperationResult(prefix_cache_stats=pb.PrefixCacheStatsResult(stats=stats))


def _sync(h: PoolHandle, s: str, op: pb.SyncOp) -> pb.OperationResult:
    sync_request(h, s, op.request)
    return pb.OperationResult()


_HANDLERS: dict[str, Callable[[PoolHandle, str, Any], pb.OperationResult]] = {
    "lookup": _lookup,
    "allocate": _allocate,
    "free": _free,
    "preempt": _preempt,
    "cache_blocks": _cache_blocks,
    "remove_skipped_blocks": _remove_skipped,
    "evict_blocks": _evict,
    "get_block_ids": _get_block_ids,
    "common_prefix": _common_prefix,
    "reset_prefix_cache": _reset,
    "take_events": _take_events,
    "make_prefix_cache_stats": _make_stats,
    "sync": _sync,
}


def apply_operation(handle: PoolHandle, session_id: str, op: pb.Operation) -> tuple[str, pb.OperationResult]:
    """Apply one operation; errors propagate (and the pool is unchanged by it)."""
    kind = op.WhichOneof("op")
    if kind is None:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "operation has no op set")
    result = _HANDLERS[kind](handle, session_id, getattr(op, kind))
    handle.publish_events()
    return kind, result
