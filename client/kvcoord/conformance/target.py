"""What a trace is replayed against: the in-process engine, or a server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvcoord.engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheHit,
    KVCacheEvent,
    KVCachePool,
    LoRA,
    PrefixCacheStats,
    hash_to_int64,
)

from .trace import config_from_trace

__all__ = ["LocalTarget", "ReplayTarget", "event_to_json", "stats_to_json"]

BlockIds = Sequence[Sequence[int]]


class ReplayTarget(Protocol):
    """The pool operations a trace exercises. Results use the trace's JSON shapes."""

    def open(self, trace_config: dict[str, Any]) -> None: ...
    def close(self) -> None: ...
    def add_request(
        self,
        rid: str,
        prompt: list[int],
        hashes: list[bytes],
        lora: LoRA | None,
        skip_read: bool,
        cache_salt: str | None = None,
    ) -> None: ...
    def update_request(
        self, rid: str, num_computed_tokens: int, tokens: list[int], hashes: list[bytes]
    ) -> None: ...
    def get_computed_blocks(self, rid: str) -> tuple[list[list[int]], int]: ...
    def allocate_slots(
        self,
        rid: str,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: BlockIds | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        num_encoder_tokens: int,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> list[list[int]] | None: ...
    def free(self, rid: str) -> None: ...
    def preempt(self, rid: str) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_events(self) -> list[dict[str, Any]]: ...
    def make_prefix_cache_stats(self) -> dict[str, Any] | None: ...
    def peek_prefix_cache_stats(self) -> dict[str, Any] | None: ...
    def get_num_common_prefix_blocks(self, rid: str) -> list[int]: ...
    def get_block_ids(self, rid: str) -> list[list[int]]: ...
    def cache_blocks(self, rid: str, num_computed_tokens: int) -> None: ...
    def remove_skipped_blocks(self, rid: str, total_computed_tokens: int) -> None: ...
    def evict_blocks(self, block_ids: list[int]) -> None: ...
    def num_free_blocks(self) -> int: ...
    def usage(self) -> float: ...
    def free_queue_head(self, limit: int) -> list[int]: ...
    # vLLM 0.33's calls (format-2 traces)
    def new_step_starts(self) -> None: ...
    def record_prefix_cache_stats(self, rid: str, num_hits: int) -> None: ...
    def estimate_cached_tokens(self, rid: str) -> int: ...
    def shared_prefix_boundary(self, rid: str) -> int: ...
    def get_num_blocks_to_allocate(
        self,
        rid: str,
        num_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool,
    ) -> int: ...
    def get_block_ids_for_computed_tokens(self, rid: str, num_computed_tokens: int) -> list[list[int]]: ...
    def take_new_block_ids(self) -> list[int]: ...
    def take_boundary_state_offloads(self) -> dict[str, list[list[int]]]: ...
    def take_kv_cache_block_copies(self) -> tuple[list[list[int]], list[int]]: ...


def event_to_json(event: KVCacheEvent) -> dict[str, Any]:
    """An engine event in the trace format (hashes as 64-bit integers)."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [hash_to_int64(h) for h in event.block_hashes],
            "parent_block_hash": (
                None if event.parent_block_hash is None else hash_to_int64(event.parent_block_hash)
            ),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            # vllm-0.33's fields, written only when set (as vLLM encodes them)
            **_present(
                extra_keys=None
                if event.extra_keys is None
                else [None if k is None else list(k) for k in event.extra_keys],
                group_idx=event.group_idx,
                kv_cache_spec_kind=event.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
                lookahead_token_ids=None
                if event.lookahead_token_ids is None
                else [list(t) for t in event.lookahead_token_ids],
            ),
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [hash_to_int64(h) for h in event.block_hashes],
            "medium": event.medium,
            **_present(group_idx=event.group_idx),
        }
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def _present(**fields: Any) -> dict[str, Any]:
    """The fields whose value is not ``None``."""
    return {k: v for k, v in fields.items() if v is not None}


def stats_to_json(stats: PrefixCacheStats | None) -> dict[str, Any] | None:
    """Prefix-cache statistics in the trace format."""
    if stats is None:
        return None
    return {
        "requests": stats.requests,
        "queries": stats.queries,
        "hits": stats.hits,
        "preempted_requests": stats.preempted_requests,
        "preempted_queries": stats.preempted_queries,
        "preempted_hits": stats.preempted_hits,
        "reset": stats.reset,
    }


def _lists(ids: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(x) for x in ids]


class LocalTarget:
    """Replays against a fresh in-process :class:`KVCachePool` per trace."""

    def __init__(self) -> None:
        self.pool: KVCachePool | None = None

    def _p(self) -> KVCachePool:
        assert self.pool is not None, "open() first"
        return self.pool

    def open(self, trace_config: dict[str, Any]) -> None:
        self.pool = KVCachePool(config_from_trace(trace_config))

    def close(self) -> None:
        self.pool = None

    def add_request(
        self,
        rid: str,
        prompt: list[int],
        hashes: list[bytes],
        lora: LoRA | None,
        skip_read: bool,
        cache_salt: str | None = None,
    ) -> None:
        self._p().add_request(
            rid, prompt, hashes, lora=lora, skip_reading_prefix_cache=skip_read, cache_salt=cache_salt
        )

    def update_request(
        self, rid: str, num_computed_tokens: int, tokens: list[int], hashes: list[bytes]
    ) -> None:
        self._p().update_request(
            rid,
            num_computed_tokens=num_computed_tokens,
            append_token_ids=tokens,
            append_block_hashes=hashes,
        )

    def get_computed_blocks(self, rid: str) -> tuple[list[list[int]], int]:
        hit = self._p().get_computed_blocks(rid)
        return _lists(hit.block_ids), hit.num_tokens

    def allocate_slots(
        self,
        rid: str,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: BlockIds | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        num_encoder_tokens: int,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> list[list[int]] | None:
        hit = None
        if new_computed_blocks is not None:
            hit = CacheHit(tuple(tuple(x) for x in new_computed_blocks), num_new_computed_tokens)
        out = self._p().allocate_slots(
            rid,
            num_new_tokens,
            num_new_computed_tokens,
            hit,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
        )
        return None if out is None else _lists(out)

    def free(self, rid: str) -> None:
        self._p().free(rid)

    def preempt(self, rid: str) -> None:
        self._p().preempt(rid)

    def reset_prefix_cache(self) -> bool:
        return self._p().reset_prefix_cache()

    def take_events(self) -> list[dict[str, Any]]:
        return [event_to_json(e) for e in self._p().take_events()]

    def make_prefix_cache_stats(self) -> dict[str, Any] | None:
        return stats_to_json(self._p().make_prefix_cache_stats())

    def peek_prefix_cache_stats(self) -> dict[str, Any] | None:
        return stats_to_json(self._p().peek_prefix_cache_stats())

    def get_num_common_prefix_blocks(self, rid: str) -> list[int]:
        return list(self._p().get_num_common_prefix_blocks(rid))

    def get_block_ids(self, rid: str) -> list[list[int]]:
        return _lists(self._p().get_block_ids(rid))

    def cache_blocks(self, rid: str, num_computed_tokens: int) -> None:
        self._p().cache_blocks(rid, num_computed_tokens)

    def remove_skipped_blocks(self, rid: str, total_computed_tokens: int) -> None:
        self._p().remove_skipped_blocks(rid, total_computed_tokens)

    def evict_blocks(self, block_ids: list[int]) -> None:
        self._p().evict_blocks(block_ids)

    def num_free_blocks(self) -> int:
        return self._p().num_free_blocks

    def usage(self) -> float:
        return self._p().usage

    def free_queue_head(self, limit: int) -> list[int]:
        return self._p().free_queue_head(limit)

    def new_step_starts(self) -> None:
        self._p().new_step_starts()

    def record_prefix_cache_stats(self, rid: str, num_hits: int) -> None:
        self._p().record_prefix_cache_stats(rid, num_hits)

    def estimate_cached_tokens(self, rid: str) -> int:
        return self._p().estimate_cached_tokens(rid)

    def get_num_blocks_to_allocate(
        self,
        rid: str,
        num_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool,
    ) -> int:
        return self._p().get_num_blocks_to_allocate(
            rid, num_tokens, total_computed_tokens, num_tokens_main_model, apply_admission_cap
        )

    def get_block_ids_for_computed_tokens(self, rid: str, num_computed_tokens: int) -> list[list[int]]:
        return _lists(self._p().get_block_ids_for_computed_tokens(rid, num_computed_tokens))

    def shared_prefix_boundary(self, rid: str) -> int:
        return self._p().shared_prefix_boundary(rid)

    def take_new_block_ids(self) -> list[int]:
        return self._p().take_new_block_ids()

    def take_boundary_state_offloads(self) -> dict[str, list[list[int]]]:
        return {
            rid: [list(e) for e in entries]
            for rid, entries in self._p().take_boundary_state_offloads().items()
        }

    def take_kv_cache_block_copies(self) -> tuple[list[list[int]], list[int]]:
        copies, retained = self._p().take_kv_cache_block_copies()
        return [list(c) for c in copies], list(retained)
