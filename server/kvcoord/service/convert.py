"""The servicer's own conversions: operations and their outcomes, fences, an exclusive
session's pool state (ScorePools' are :mod:`.score_wire`'s). Engine values both sides
convert (layouts, ids, hits, stats, events, pool state) live in :mod:`kvcoord.wire`.
Engine types never see protobuf."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from kvcoord.engine import CacheHit, Counts, HandedTokenIds, PrefixCacheStats, TokenIds
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import (
    add_events,
    block_ids_to_pb,
    copies_to_pb,
    extra_key_sources_from_pb,
    hit_from_pb,
    hit_to_pb,
    ids_from_pb,
    lora_from_pb,
    offloads_to_pb,
    stats_to_pb,
    uncomputed_from_pb,
    write_ids,
)
from kvcoord.wire.columns import packed_decode_columns

from . import operations as op
from .errors import ServiceError, Status, bounded
from .pool_service import Fence, MirrorState
from .wire_slices import encode_varint

__all__ = [
    "allocate_from_pb",
    "allocate_to_pb",
    "error_to_result",
    "fence_from_pb",
    "fence_to_pb",
    "operation_from_pb",
    "outcome_to_pb",
    "write_outcome",
    "write_mirror_state",
    "write_results",
    "sync_from_pb",
]


# -- operations -------------------------------------------------------------------------
def fence_from_pb(fence: pb.Fence, present: bool) -> Fence | None:
    """``None`` when the caller sent no fence (nothing to check)."""
    if not present:
        return None
    return Fence(fence.instance_id, fence.incarnation, fence.position, fence.term, fence.position_tag)


def fence_to_pb(fence: Fence) -> pb.Fence:
    return pb.Fence(instance_id=fence.instance_id, incarnation=fence.incarnation, term=fence.term)


def sync_from_pb(s: pb.RequestSync) -> op.RequestSync:
    if not s.new_request:
        # A registered request's positioned sync: what registers a request (lora,
        # skip_reading_prefix_cache, num_preemptions, cache_salt, kv_cache_report_full)
        # is read only when it is new (PoolService.sync), so it is not read here (a
        # decode step's syncs); num_prompt_tokens is (a streaming session's prompt grew).
        return op.RequestSync(
            s.request_id,
            TokenIds(s.append_token_ids[:]),  # a slice is copied in C, not item by item
            s.append_block_hashes[:],
            False,
            s.base_num_tokens,
            s.base_num_hashes,
            s.num_computed_tokens if s.HasField("num_computed_tokens") else None,
            num_prompt_tokens=s.num_prompt_tokens if s.HasField("num_prompt_tokens") else None,
            rewind_num_tokens=s.rewind_num_tokens if s.HasField("rewind_num_tokens") else None,
        )
    return op.RequestSync(
        s.request_id,
        # uint32 on the wire: the engine need not check each one; made for this sync
        # alone, and nothing reads it once applied: a new request's engine record keeps
        # this very list (as long_syncs.py hands a long prompt's), not a copy of it
        HandedTokenIds(s.append_token_ids[:]),
        s.append_block_hashes[:],
        s.new_request,
        s.base_num_tokens,
        s.base_num_hashes,
        s.num_computed_tokens if s.HasField("num_computed_tokens") else None,
        lora_from_pb(s.lora) if s.HasField("lora") else None,
        s.skip_reading_prefix_cache,
        s.num_preemptions if s.HasField("num_preemptions") else None,
        s.cache_salt or None,
        extra_key_sources_from_pb(s),
        s.num_prompt_tokens if s.HasField("num_prompt_tokens") else None,
        s.kv_cache_report_full,
        s.rewind_num_tokens if s.HasField("rewind_num_tokens") else None,
    )


_ALLOCATE_FIELD = pb.AllocateOp.DESCRIPTOR.fields_by_name
_REQUEST_NUMBER = _ALLOCATE_FIELD["request"].number
_NUM_NEW_TOKENS_NUMBER = _ALLOCATE_FIELD["num_new_tokens"].number


def allocate_from_pb(a: pb.AllocateOp, num_groups: int) -> op.Allocate:
    fields = a.ListFields()
    if (
        len(fields) == 2
        and fields[0][0].number == _REQUEST_NUMBER
        and fields[1][0].number == _NUM_NEW_TOKENS_NUMBER
    ):
        # a plain allocation (every other field at its default: a decode step's), read
        # from the fields set alone (one call, not one per field)
        sync = sync_from_pb(fields[0][1])
        return op.Allocate(sync, fields[1][1], plain=not sync.new_request)
    return op.Allocate(
        sync_from_pb(a.request),
        a.num_new_tokens,
        a.num_new_computed_tokens,
        hit_from_pb(a.new_computed_blocks) if a.HasField("new_computed_blocks") else None,
        a.num_lookahead_tokens,
        a.num_external_computed_tokens,
        a.delay_cache_blocks,
        a.num_encoder_tokens,
        a.lookup,
        a.must_succeed,
        a.must_refuse,
        a.return_table,
        a.full_sequence_must_fit,
        a.reserved_blocks,
        a.num_in_flight_tokens,
        a.watermark_blocks,
        tuple(a.skip_zeroing_group_ids),
    )


def operation_from_pb(o: pb.Operation, num_groups: int) -> op.Operation:
    """One wire operation as a plain one (INVALID_ARGUMENT when none is set)."""
    kind = o.WhichOneof("op")
    if kind == "allocate":
        return allocate_from_pb(o.allocate, num_groups)
    if kind == "decode":
        d = o.decode
        packed = packed_decode_columns(d)
        return op.Decode(*(_run_columns(d) if packed is None else packed), d.must_succeed)
    if kind == "lookup":
        lk = o.lookup
        if not lk.hint and not lk.HasField("answered"):
            return op.Lookup(sync_from_pb(lk.request))
        answered = None
        if lk.HasField("answered"):
            if len(lk.answered.groups) != num_groups:
                raise ServiceError(
                    Status.INVALID,
                    f"lookup.answered must have one block list per KV cache group ({num_groups}), "
                    f"got {len(lk.answered.groups)}",
                )
            answered = CacheHit(ids_from_pb(lk.answered.groups), lk.answered.num_tokens)
        return op.Lookup(sync_from_pb(lk.request), lk.hint, lk.walk_limit, answered)
    if kind == "free":
        f = o.free
        return op.Free(f.request_id, f.if_held, f.all_groups_reversed, uncomputed_from_pb(f))
    if kind == "preempt":
        return op.Preempt(o.preempt.request_id)
    if kind == "cache_blocks":
        return op.CacheBlocks(sync_from_pb(o.cache_blocks.request), o.cache_blocks.num_computed_tokens)
    if kind == "remove_skipped_blocks":
        r = o.remove_skipped_blocks
        return op.RemoveSkipped(sync_from_pb(r.request), r.total_computed_tokens)
    if kind == "evict_blocks":
        return op.EvictBlocks(o.evict_blocks.block_ids)
    if kind == "get_block_ids":
        g = o.get_block_ids
        table = ids_from_pb(g.answered.groups) if g.HasField("answered") else None
        return op.GetBlockIds(
            g.request_id, table, g.computed_tokens if g.HasField("computed_tokens") else None
        )
    if kind == "common_prefix":
        return op.CommonPrefix(o.common_prefix.request_id)
    if kind == "reset_prefix_cache":
        return op.ResetPrefixCache()
    if kind == "take_events":
        return op.TakeEvents()
    if kind == "make_prefix_cache_stats":
        return op.MakeStats(o.make_prefix_cache_stats.peek)
    if kind == "sync":
        return op.Sync(sync_from_pb(o.sync.request))
    if kind == "record_prefix_cache_stats":
        rec = o.record_prefix_cache_stats
        return op.RecordStats(rec.request_id, rec.num_hits)
    if kind == "estimate_cached_tokens":
        return op.EstimateCachedTokens(o.estimate_cached_tokens.request_id)
    if kind == "new_step_starts":
        return op.NewStepStarts()
    if kind == "take_new_block_ids":
        return op.TakeNewBlockIds()
    if kind == "take_boundary_state_offloads":
        return op.TakeBoundaryStateOffloads()
    if kind == "take_kv_cache_block_copies":
        return op.TakeBlockCopies()
    if kind == "release_retained_blocks":
        return op.ReleaseRetained(list(o.release_retained_blocks.block_ids))
    if kind == "drop_boundary_state_offloads":
        return op.DropOffloads(o.drop_boundary_state_offloads.request_id)
    if kind == "record_blocks_for_zeroing":
        z = o.record_blocks_for_zeroing
        return op.RecordForZeroing(z.request_id, z.start_token)
    if kind == "drop_uncomputed":
        return op.DropUncomputed(o.drop_uncomputed.request_id, o.drop_uncomputed.uncomputed_from)
    if kind == "get_num_blocks_to_allocate":
        n = o.get_num_blocks_to_allocate
        return op.GetNumBlocksToAllocate(
            n.request_id, n.num_tokens, n.total_computed_tokens, n.num_tokens_main_model,
            n.apply_admission_cap, n.num_encoder_tokens,
        )  # fmt: skip
    if kind == "allocate_run":
        run = o.allocate_run
        return op.AllocateRun(*_run_columns(run), _run_checks(run))
    if kind == "admit":
        a = o.admit
        return op.Admit([sync_from_pb(r) for r in a.requests], a.token_budget, a.num_lookahead_tokens)
    raise ServiceError(Status.INVALID, "operation has no op set")


_Columns = tuple[
    Sequence[str], Sequence[int], Sequence[int], Sequence[int], Sequence[int], Sequence[int], Sequence[int],
    Sequence[int], Sequence[int], Sequence[bytes],
]  # fmt: skip


def _run_columns(run: pb.AllocateRunOp | pb.DecodeOp) -> _Columns:
    """An AllocateRunOp's or DecodeOp's columns as lists (indexing and slicing one costs
    less than a wire container's; a slice is copied in C, ``list()`` reads item by item),
    the tokens as TokenIds and the counts the engine checks as Counts (uint32 on the
    wire: the engine need not check each one's type and sign)."""
    return (
        run.request_ids[:],
        run.base_num_tokens[:],
        run.base_num_hashes[:],
        Counts(run.num_computed_tokens[:]),
        Counts(run.num_new_tokens[:]),
        Counts(run.num_lookahead_tokens[:]),
        run.num_append_tokens[:],
        TokenIds(run.append_token_ids[:]),
        Counts(run.num_append_hashes[:]),
        run.append_block_hashes[:],
    )


def _run_checks(run: pb.AllocateRunOp) -> op.RunChecks | None:
    if not run.check_request_ids and not run.check_at:
        return None
    return op.RunChecks(
        run.check_request_ids[:],
        run.check_at[:],
        run.check_num_computed_tokens[:],
        run.check_num_new_tokens[:],
        run.check_num_lookahead_tokens[:],
        run.check_num_tokens[:],
    )


def write_decode(out: pb.DecodeResult, d: op.DecodeOutcome) -> None:
    """Fill ``out`` with a Decode's answer (the columns at once)."""
    out.num_applied = d.num_applied
    out.num_new_blocks.extend(d.num_new_blocks)
    out.new_block_ids.extend(d.new_block_ids)
    out.refused.extend(d.refused)
    out.SetInParent()


def write_allocate(out: pb.AllocateResult, a: op.AllocateOutcome) -> None:
    """Fill ``out`` (a field of the answer being built) with an allocation's outcome."""
    if a.new_block_ids is None:
        if a.stale_hit:
            out.stale_hit = True
        else:
            out.refused = True
    else:
        write_ids(out.new_block_ids, a.new_block_ids)
    out.num_new_tokens = a.num_new_tokens
    if a.hit is not None:
        out.hit.num_tokens = a.hit.num_tokens
        write_ids(out.hit.groups, a.hit.block_ids)
    if a.table is not None:
        write_ids(out.table, a.table)


def allocate_to_pb(a: op.AllocateOutcome) -> pb.AllocateResult:
    out = pb.AllocateResult()
    write_allocate(out, a)
    return out


def error_to_result(err: ServiceError) -> pb.OperationResult:
    """A failed operation's result: code, bounded message, reason and position."""
    r = pb.OperationResult(status_code=int(err.code.value[0]), status_message=bounded(err.message))
    if err.reason is not None:
        r.reason = err.reason.value  # type: ignore[assignment]
    if err.position is not None:
        p = err.position
        r.position.CopyFrom(
            pb.RequestPosition(
                request_id=p.request_id,
                exists=p.exists,
                num_tokens=p.num_tokens,
                num_hashes=p.num_hashes,
                num_computed_tokens=p.num_computed_tokens,
            )
        )
    return r


_ABORTED = int(grpc.StatusCode.ABORTED.value[0])


def write_outcome(target: pb.OperationResult, operation: op.Operation, o: op.Outcome) -> None:
    """Fill ``target`` (an element of the answer being built) with an outcome."""
    if o.error is None and o.aborted_by is None:  # the common cases, without copies
        if type(operation) is op.Allocate:
            assert isinstance(o.value, op.AllocateOutcome)
            write_allocate(target.allocate, o.value)
            return
        if type(operation) is op.Decode:
            assert isinstance(o.value, op.DecodeOutcome)
            write_decode(target.decode, o.value)
            return
    target.CopyFrom(outcome_to_pb(operation, o))


#: StepResponse.results (field 1, length-delimited): one element's tag
_RESULTS_TAG = b"\x0a"
#: the encoded StepResponse.results element of an allocation that took no block, by
#: (groups, num_new_tokens): a decode step inside its last block (most decode steps)
_UNCHANGED_RESULTS: dict[tuple[int, int], bytes] = {}


def _unchanged_result(groups: int, num_new_tokens: int) -> bytes:
    """``results`` element bytes of OperationResult{allocate{new_block_ids: ``groups``
    empty lists, num_new_tokens}}, made by protobuf itself once and kept (the answer is
    parsed back from them, then serialized from the message as any other answer)."""
    key = (groups, num_new_tokens)
    chunk = _UNCHANGED_RESULTS.get(key)
    if chunk is None:
        r = pb.OperationResult()
        write_allocate(r.allocate, op.AllocateOutcome(((),) * groups, num_new_tokens))
        body = r.SerializeToString()
        chunk = _RESULTS_TAG + encode_varint(len(body)) + body
        if len(_UNCHANGED_RESULTS) < 4096:  # a handful in practice (groups x tokens per step)
            _UNCHANGED_RESULTS[key] = chunk
    return chunk


def write_results(
    response: pb.StepResponse, ops: Sequence[op.Operation], outcomes: Sequence[op.Outcome]
) -> None:
    """Append each operation's result to ``response.results``, in order: what
    :func:`write_outcome` on each new element writes. An allocation that took no block
    (most of a decode step's) is appended from bytes kept per shape, runs of them
    merged at once: reading its fields one by one costs more than the rest of it."""
    results = response.results
    pending: list[bytes] = []
    for operation, o in zip(ops, outcomes, strict=True):
        if type(operation) is op.Allocate and o.error is None and o.aborted_by is None:
            v = o.value
            assert isinstance(v, op.AllocateOutcome)
            ids = v.new_block_ids
            if ids is not None and v.hit is None and v.table is None and not v.stale_hit and not any(ids):
                pending.append(_unchanged_result(len(ids), v.num_new_tokens))
                continue
        if pending:
            response.MergeFromString(b"".join(pending))
            pending = []
        write_outcome(results.add(), operation, o)
    if pending:
        response.MergeFromString(b"".join(pending))


def outcome_to_pb(operation: op.Operation, o: op.Outcome) -> pb.OperationResult:
    """A plain outcome as its wire result (the operation says which field is set)."""
    if o.aborted_by is not None:
        return pb.OperationResult(
            status_code=_ABORTED, status_message=f"not applied: operation {o.aborted_by} failed"
        )
    if o.error is not None:
        r = error_to_result(o.error)
        if isinstance(o.error, op.DecodeFailed):  # the entries before the failing one
            write_decode(r.decode, o.error.partial)
        return r
    v = o.value
    if isinstance(operation, op.Allocate):
        assert isinstance(v, op.AllocateOutcome)
        return pb.OperationResult(allocate=allocate_to_pb(v))
    if isinstance(operation, op.AllocateRun):
        assert isinstance(v, op.RunOutcome)
        r = pb.OperationResult()
        r.allocate_run.num_new_blocks.extend(v.num_new_blocks)
        r.allocate_run.new_block_ids.extend(v.new_block_ids)
        r.allocate_run.SetInParent()
        return r
    if isinstance(operation, op.Decode):
        assert isinstance(v, op.DecodeOutcome)
        r = pb.OperationResult()
        write_decode(r.decode, v)
        return r
    if isinstance(operation, op.Admit):
        assert isinstance(v, op.Admitted)
        r = pb.OperationResult()
        for outcome in v.outcomes:
            write_allocate(r.admit.results.add(), outcome)
        r.admit.SetInParent()
        return r
    if isinstance(operation, op.Lookup):
        if isinstance(v, op.LookedUp):
            return pb.OperationResult(
                lookup=pb.LookupResult(hit=hit_to_pb(v.hit), shared_prefix_boundary=v.shared_prefix_boundary)
            )
        if isinstance(v, op.Hinted):
            return pb.OperationResult(
                lookup=pb.LookupResult(hit=hit_to_pb(v.hit), eviction_margin=v.eviction_margin)
            )
        assert isinstance(v, CacheHit)
        return pb.OperationResult(lookup=pb.LookupResult(hit=hit_to_pb(v)))
    if isinstance(operation, op.GetBlockIds):
        return pb.OperationResult(
            get_block_ids=pb.GetBlockIdsResult(groups=block_ids_to_pb(v))  # type: ignore[arg-type]
        )
    if isinstance(operation, op.CommonPrefix):
        return pb.OperationResult(common_prefix=pb.CommonPrefixResult(num_blocks=v))  # type: ignore[arg-type]
    if isinstance(operation, op.ResetPrefixCache):
        return pb.OperationResult(reset_prefix_cache=pb.ResetPrefixCacheResult(result=bool(v)))
    if isinstance(operation, op.EstimateCachedTokens):
        assert isinstance(v, int)
        return pb.OperationResult(estimate_cached_tokens=pb.EstimateCachedTokensResult(num_tokens=v))
    if isinstance(operation, op.GetNumBlocksToAllocate):
        assert isinstance(v, int)
        return pb.OperationResult(get_num_blocks_to_allocate=pb.GetNumBlocksToAllocateResult(num_blocks=v))
    if isinstance(operation, op.TakeNewBlockIds):
        assert isinstance(v, list)
        return pb.OperationResult(take_new_block_ids=pb.TakeNewBlockIdsResult(block_ids=v))
    if isinstance(operation, op.TakeBoundaryStateOffloads):
        assert isinstance(v, dict)
        return pb.OperationResult(take_boundary_state_offloads=offloads_to_pb(v))
    if isinstance(operation, op.TakeBlockCopies):
        assert isinstance(v, tuple)
        return pb.OperationResult(take_kv_cache_block_copies=copies_to_pb(*v))
    if isinstance(operation, op.ReleaseRetained):
        return pb.OperationResult(release_retained_blocks=pb.ReleaseRetainedBlocksResult())
    if isinstance(operation, op.DropOffloads):
        return pb.OperationResult(drop_boundary_state_offloads=pb.DropBoundaryStateOffloadsResult())
    if isinstance(operation, op.RecordForZeroing):
        return pb.OperationResult(record_blocks_for_zeroing=pb.RecordBlocksForZeroingResult())
    if isinstance(operation, op.TakeEvents):
        assert isinstance(v, op.EventsTaken)
        result = pb.OperationResult(take_events=pb.TakeEventsResult(gap=v.gap, more=v.more))
        add_events(result.take_events.events, v.events)
        return result
    if isinstance(operation, op.MakeStats):
        assert v is None or isinstance(v, PrefixCacheStats)
        return pb.OperationResult(prefix_cache_stats=pb.PrefixCacheStatsResult(stats=stats_to_pb(v)))
    return pb.OperationResult()


def write_mirror_state(response: pb.AttachResponse, state: MirrorState | str) -> None:
    """An Attach answer's engine state for a mirror (:meth:`PoolService.mirror_state`),
    or why there is none."""
    if isinstance(state, str):
        response.pool_state_unavailable = state
        return
    out = response.pool_state
    out.engine_state = state.engine_state
    out.engine_state_version = state.version
    out.engine_rules = state.rules
    out.cache_namespace = state.cache_namespace
