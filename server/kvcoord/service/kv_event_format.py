"""A batch of a pool's KV events as vLLM's own publisher encodes it (kv_publisher.py
sends it), in the format of the vLLM release the pool's profile follows.

The payload is msgpack of ``KVEventBatch`` in msgspec's array form:
``[ts, [event, ...], data_parallel_rank]``. In 0.16 each event is a tagged array:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``. In 0.33 each event is a map tagged by ``"type"``, its
keys in vLLM's field order, the optional fields (default ``None``) left out when
``None`` (msgspec's ``omit_defaults``): ``{"type": "BlockStored", "block_hashes",
"parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"``
(always), then ``"extra_keys"`` (one entry per block: ``None`` or the block's
untagged extra keys), ``"group_idx"``, ``"kv_cache_spec_kind"``,
``"kv_cache_spec_sliding_window"``, ``"lookahead_token_ids"`` when set``}``;
``{"type": "BlockRemoved", "block_hashes", "medium"[, "group_idx"]}``;
``{"type": "AllBlocksCleared"}``. 0.33's ``locality``, ``ownership`` and
``session_id`` are never set (kvcoord has no offloading tiers and no sessions in
vLLM's sense), so they are never written. Hashes are, with ``int_hashes`` (a
publisher's default, as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on by
default), their last 8 bytes as an unsigned integer, else the clients' raw bytes.

msgspec is the optional extra ``kvcoord[zmq]`` (imported when a batch is encoded).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, hash_to_int64
from kvcoord.engine.profiles import PROFILES, VLLM_016, VLLM_033

__all__ = ["encode_batch", "event_fields", "event_struct_033"]


def _hash(h: bytes, as_int: bool) -> bytes | int:
    return hash_to_int64(h) if as_int else h


def _stored_fields(event: BlockStored, int_hashes: bool) -> list[Any]:
    """The seven fields every vLLM release's BlockStored has, in their order."""
    parent = event.parent_block_hash
    return [
        [_hash(h, int_hashes) for h in event.block_hashes],
        None if parent is None else _hash(parent, int_hashes),
        list(event.token_ids),
        event.block_size,
        event.lora_id,
        event.medium,
        event.lora_name,
    ]


def event_fields(event: KVCacheEvent, int_hashes: bool = False) -> list[Any]:
    """One event as vLLM 0.16's tagged array (its msgspec ``array_like``, ``tag=True`` form)."""
    if isinstance(event, BlockStored):
        return ["BlockStored", *_stored_fields(event, int_hashes)]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [_hash(h, int_hashes) for h in event.block_hashes], event.medium]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]


@functools.cache
def _schema_033() -> tuple[type, type, type]:
    """vLLM 0.33's event layout as msgspec structs (the map form: ``tag=True``, keyed
    by ``"type"``, ``omit_defaults``): msgspec sizes a struct's map header by its field
    count (a 16-entry map16 for BlockStored), so only structs of the same fields, in
    the same order, encode to the same bytes as vLLM's own publisher."""
    import msgspec

    class Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: Any = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        # offloading tiers and vLLM sessions: kvcoord has none, never set
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None
        lookahead_token_ids: Any = None

    class BlockRemoved(Event):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(Event):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


def event_struct_033(event: KVCacheEvent, int_hashes: bool = False) -> Any:
    """One event as vLLM 0.33 encodes it: a map tagged ``"type"``, the fields in vLLM's
    order, each optional one (default ``None``) only when set."""
    stored, removed, cleared = _schema_033()
    if isinstance(event, BlockStored):
        return stored(
            *_stored_fields(event, int_hashes),
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            lookahead_token_ids=event.lookahead_token_ids,
        )
    if isinstance(event, BlockRemoved):
        return removed([_hash(h, int_hashes) for h in event.block_hashes], event.medium, event.group_idx)
    assert isinstance(event, AllBlocksCleared)
    return cleared()


def encode_batch(
    ts: float,
    events: Sequence[KVCacheEvent],
    data_parallel_rank: int = 0,
    int_hashes: bool = False,
    profile: str = VLLM_016,
) -> bytes:
    """A ``KVEventBatch`` payload, as the publisher of the vLLM release ``profile``
    follows (``vllm-0.16`` or ``vllm-0.33``) encodes it.

    Raises:
        ValueError: an unknown profile.
    """
    import msgspec

    if profile == VLLM_016:
        encoded: list[Any] = [event_fields(e, int_hashes) for e in events]
    elif profile == VLLM_033:
        encoded = [event_struct_033(e, int_hashes) for e in events]
    else:
        raise ValueError(f"no KV event format for profile {profile!r} (known: {', '.join(PROFILES)})")
    return msgspec.msgpack.encode([ts, encoded, data_parallel_rank])
