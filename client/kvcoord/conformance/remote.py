"""Replaying traces through the gRPC client against a running server."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

from kvcoord.client import KVCoordClient, TLSOptions
from kvcoord.client.errors import error_from_code, status_code
from kvcoord.client.retry import DEFAULT_RETRY, RetryPolicy
from kvcoord.engine import LoRA
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import allocate_op, copies_from_pb, events_from_pb, offloads_from_pb, stats_from_pb

from .target import BlockIds, event_to_json, stats_to_json
from .trace import pool_config_from_trace

__all__ = ["Prompt", "RemoteTarget"]


def _lists(groups: Sequence[pb.BlockIds]) -> list[list[int]]:
    return [list(g.block_ids) for g in groups]


def _stats_json(r: pb.OperationResult) -> dict[str, Any] | None:
    stats = r.prefix_cache_stats
    return stats_to_json(stats_from_pb(stats.stats)) if stats.HasField("stats") else None


@dataclasses.dataclass(slots=True)
class Prompt:
    """A request's tokens and block hashes so far, its LoRA and cache salt, as the
    trace gave them (what a router scoring the request's prompt needs)."""

    tokens: list[int]
    hashes: list[bytes]
    lora: LoRA | None
    cache_salt: str | None


class RemoteTarget:
    """A fresh pool per trace on a server; request updates ride on the next operation.

    Every Step carries the fence of the session; an answer from a restarted server
    that recovered this pool (same incarnation, new instance) carries the new fence,
    which the target adopts, so a replay goes on across restarts.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        tls: TLSOptions | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        self.client = KVCoordClient(address, timeout=timeout, token=token, tls=tls, retry=retry)
        self.pool = ""
        self.session = ""
        self.fence = pb.Fence()
        self._pending: dict[str, pb.RequestSync] = {}
        #: (tokens, hashes) the server holds per request: the position of the next sync
        self._pos: dict[str, tuple[int, int]] = {}
        self._free = 0
        self._usage = 0.0
        #: the shared-prefix boundary each request's last lookup answered (vllm-0.33)
        self._boundary: dict[str, int] = {}
        #: each live request's prompt so far
        self.prompts: dict[str, Prompt] = {}

    def open(self, trace_config: dict[str, Any]) -> None:
        self.pool = f"conformance-{trace_config.get('name', 'trace')}-{uuid.uuid4().hex[:8]}"
        cfg = pool_config_from_trace(trace_config)
        self.client.create_pool(self.pool, cfg)
        if cfg.profile:
            att = self.client.attach(
                self.pool,
                cfg.hash_algo,
                cfg.hash_block_size,
                cfg.hash_seed,
                "conformance",
                profile=cfg.profile,
                num_hash_lookahead_tokens=cfg.num_hash_lookahead_tokens,
            )
        else:  # the default profile: clients older than profiles work too
            att = self.client.attach(
                self.pool, cfg.hash_algo, cfg.hash_block_size, cfg.hash_seed, client_name="conformance"
            )
        self.session = att.session_id
        self.fence = att.fence

    def close(self) -> None:
        try:
            if self.pool:
                self.client.delete_pool(self.pool)
        finally:
            self.client.close()

    # -- plumbing ------------------------------------------------------------------
    def _sync(self, rid: str) -> pb.RequestSync:
        sync = self._pending.pop(rid, None) or pb.RequestSync(request_id=rid)
        if not sync.new_request:
            sync.base_num_tokens, sync.base_num_hashes = self._pos.get(rid, (0, 0))
        base = (0, 0) if sync.new_request else (sync.base_num_tokens, sync.base_num_hashes)
        self._pos[rid] = (base[0] + len(sync.append_token_ids), base[1] + len(sync.append_block_hashes))
        return sync

    def _step(self, *ops: pb.Operation) -> pb.OperationResult:
        resp = self.client.step(self.pool, list(ops), self.session, self.fence)
        if resp.fence.incarnation == self.fence.incarnation:
            self.fence = resp.fence
        self._free = resp.num_free_blocks
        self._usage = resp.usage
        for r in resp.results:
            if r.status_code:
                reason = pb.ErrorReason.Name(r.reason) if r.reason else ""
                raise error_from_code(status_code(r.status_code), r.status_message, "Step", reason)
        last: pb.OperationResult = resp.results[-1]
        return last

    def _flush(self, rid: str) -> list[pb.Operation]:
        if rid not in self._pending:
            return []
        return [pb.Operation(sync=pb.SyncOp(request=self._sync(rid)))]

    # -- ReplayTarget -------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        prompt: list[int],
        hashes: list[bytes],
        lora: LoRA | None,
        skip_read: bool,
        cache_salt: str | None = None,
    ) -> None:
        sync = pb.RequestSync(
            request_id=rid, append_token_ids=prompt, append_block_hashes=hashes,
            skip_reading_prefix_cache=skip_read, num_computed_tokens=0, new_request=True,
            cache_salt=cache_salt or "",
        )  # fmt: skip
        if lora is not None:
            sync.lora.adapter_id = lora.adapter_id
            sync.lora.name = lora.name
        self._pending[rid] = sync
        self.prompts[rid] = Prompt(list(prompt), list(hashes), lora, cache_salt)

    def update_request(
        self, rid: str, num_computed_tokens: int, tokens: list[int], hashes: list[bytes]
    ) -> None:
        sync = self._pending.setdefault(rid, pb.RequestSync(request_id=rid))
        sync.append_token_ids.extend(tokens)
        sync.append_block_hashes.extend(hashes)
        sync.num_computed_tokens = num_computed_tokens
        prompt = self.prompts.get(rid)
        if prompt is not None:  # else the server refuses the sync: the replay reports it
            prompt.tokens.extend(tokens)
            prompt.hashes.extend(hashes)

    def get_computed_blocks(self, rid: str) -> tuple[list[list[int]], int]:
        r = self._step(pb.Operation(lookup=pb.LookupOp(request=self._sync(rid))))
        self._boundary[rid] = r.lookup.shared_prefix_boundary
        return _lists(r.lookup.hit.groups), r.lookup.hit.num_tokens

    def allocate_slots(self, rid: str, num_new_tokens: int, num_new_computed_tokens: int,
                       new_computed_blocks: BlockIds | None, num_lookahead_tokens: int,
                       num_external_computed_tokens: int, delay_cache_blocks: bool,
                       num_encoder_tokens: int, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0) -> list[list[int]] | None:  # fmt: skip
        op = allocate_op(self._sync(rid), num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                            num_encoder_tokens)  # fmt: skip
        op.full_sequence_must_fit = full_sequence_must_fit
        op.reserved_blocks = reserved_blocks
        r = self._step(pb.Operation(allocate=op))
        return None if r.allocate.refused else _lists(r.allocate.new_block_ids)

    def free(self, rid: str) -> None:
        self._step(*self._flush(rid), pb.Operation(free=pb.FreeOp(request_id=rid)))
        self._pos.pop(rid, None)
        self.prompts.pop(rid, None)

    def preempt(self, rid: str) -> None:
        self._step(*self._flush(rid), pb.Operation(preempt=pb.PreemptOp(request_id=rid)))

    def reset_prefix_cache(self) -> bool:
        return self._step(pb.Operation(reset_prefix_cache=pb.ResetPrefixCacheOp())).reset_prefix_cache.result

    def take_events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:  # an answer holds what fits below max_message_bytes; `more` says the rest waits
            taken = self._step(pb.Operation(take_events=pb.TakeEventsOp())).take_events
            out.extend(event_to_json(e) for e in events_from_pb(taken.events))
            if not taken.more:
                return out

    def make_prefix_cache_stats(self) -> dict[str, Any] | None:
        r = self._step(pb.Operation(make_prefix_cache_stats=pb.MakePrefixCacheStatsOp()))
        return _stats_json(r)

    def peek_prefix_cache_stats(self) -> dict[str, Any] | None:
        r = self._step(pb.Operation(make_prefix_cache_stats=pb.MakePrefixCacheStatsOp(peek=True)))
        return _stats_json(r)

    def get_num_common_prefix_blocks(self, rid: str) -> list[int]:
        r = self._step(*self._flush(rid), pb.Operation(common_prefix=pb.CommonPrefixOp(request_id=rid)))
        return list(r.common_prefix.num_blocks)

    def get_block_ids(self, rid: str) -> list[list[int]]:
        r = self._step(*self._flush(rid), pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id=rid)))
        return _lists(r.get_block_ids.groups)

    def cache_blocks(self, rid: str, num_computed_tokens: int) -> None:
        self._step(
            pb.Operation(
                cache_blocks=pb.CacheBlocksOp(
                    request=self._sync(rid), num_computed_tokens=num_computed_tokens
                )
            )
        )

    def remove_skipped_blocks(self, rid: str, total_computed_tokens: int) -> None:
        op = pb.RemoveSkippedBlocksOp(request=self._sync(rid), total_computed_tokens=total_computed_tokens)
        self._step(pb.Operation(remove_skipped_blocks=op))

    def evict_blocks(self, block_ids: list[int]) -> None:
        self._step(pb.Operation(evict_blocks=pb.EvictBlocksOp(block_ids=block_ids)))

    def num_free_blocks(self) -> int:
        return self._free

    def usage(self) -> float:
        return self._usage

    def free_queue_head(self, limit: int) -> list[int]:
        resp = self.client.inspect_pool(self.pool, free_queue_limit=limit)
        self._free, self._usage = resp.num_free_blocks, resp.usage
        return list(resp.free_queue_head)

    # -- vLLM 0.33's calls --------------------------------------------------------------
    def new_step_starts(self) -> None:
        self._step(pb.Operation(new_step_starts=pb.NewStepStartsOp()))

    def record_prefix_cache_stats(self, rid: str, num_hits: int) -> None:
        op = pb.RecordPrefixCacheStatsOp(request_id=rid, num_hits=num_hits)
        self._step(*self._flush(rid), pb.Operation(record_prefix_cache_stats=op))

    def estimate_cached_tokens(self, rid: str) -> int:
        op = pb.EstimateCachedTokensOp(request_id=rid)
        r = self._step(*self._flush(rid), pb.Operation(estimate_cached_tokens=op))
        return r.estimate_cached_tokens.num_tokens

    def get_num_blocks_to_allocate(
        self,
        rid: str,
        num_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool,
    ) -> int:
        op = pb.GetNumBlocksToAllocateOp(
            request_id=rid, num_tokens=num_tokens, total_computed_tokens=total_computed_tokens,
            num_tokens_main_model=num_tokens_main_model, apply_admission_cap=apply_admission_cap,
        )  # fmt: skip
        r = self._step(*self._flush(rid), pb.Operation(get_num_blocks_to_allocate=op))
        return r.get_num_blocks_to_allocate.num_blocks

    def get_block_ids_for_computed_tokens(self, rid: str, num_computed_tokens: int) -> list[list[int]]:
        op = pb.GetBlockIdsOp(request_id=rid, computed_tokens=num_computed_tokens)
        r = self._step(*self._flush(rid), pb.Operation(get_block_ids=op))
        return _lists(r.get_block_ids.groups)

    def shared_prefix_boundary(self, rid: str) -> int:
        return self._boundary.get(rid, 0)

    def take_new_block_ids(self) -> list[int]:
        r = self._step(pb.Operation(take_new_block_ids=pb.TakeNewBlockIdsOp()))
        return list(r.take_new_block_ids.block_ids)

    def take_boundary_state_offloads(self) -> dict[str, list[list[int]]]:
        r = self._step(pb.Operation(take_boundary_state_offloads=pb.TakeBoundaryStateOffloadsOp()))
        return {
            rid: [list(e) for e in v] for rid, v in offloads_from_pb(r.take_boundary_state_offloads).items()
        }

    def take_kv_cache_block_copies(self) -> tuple[list[list[int]], list[int]]:
        r = self._step(pb.Operation(take_kv_cache_block_copies=pb.TakeKVCacheBlockCopiesOp()))
        copies, retained = copies_from_pb(r.take_kv_cache_block_copies)
        return [list(c) for c in copies], retained
