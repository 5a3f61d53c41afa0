"""KV cache events: engine values <-> KVEvent messages, and the events digest a Step
may ask for instead of the events (StepRequest.events_digest)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcoord.v1 import allocator_pb2 as pb

from .errors import WireError

__all__ = [
    "add_events",
    "event_from_pb",
    "event_to_pb",
    "events_digest",
    "events_from_pb",
    "events_message_digest",
    "fill_event",
]


def add_events(target: Any, events: Iterable[KVCacheEvent]) -> None:
    """Append ``events`` to the repeated KVEvent field ``target``, filled in place (no
    message built and then copied: a Step may carry hundreds of events)."""
    add = target.add
    for event in events:
        fill_event(add(), event)


def event_to_pb(event: KVCacheEvent) -> pb.KVEvent:
    message = pb.KVEvent()
    fill_event(message, event)
    return message


def fill_event(message: pb.KVEvent, event: KVCacheEvent) -> None:
    """Make ``message`` (an empty KVEvent, e.g. a repeated field's new element) ``event``."""
    if isinstance(event, BlockRemoved):
        removed = message.block_removed
        removed.block_hashes.extend(event.block_hashes)
        removed.medium = event.medium
        if event.group_idx is not None:  # vllm-0.33's field
            removed.group_idx = event.group_idx
    elif isinstance(event, BlockStored):
        stored = message.block_stored
        stored.block_hashes.extend(event.block_hashes)
        stored.token_ids.extend(event.token_ids)
        stored.block_size = event.block_size
        stored.medium = event.medium
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        if event.lora_id is not None:
            stored.lora_id = event.lora_id
        if event.lora_name is not None:
            stored.lora_name = event.lora_name
        if event.group_idx is not None:  # vllm-0.33's fields
            stored.group_idx = event.group_idx
        if event.kv_cache_spec_kind is not None:
            stored.kv_cache_spec_kind = event.kv_cache_spec_kind
        if event.kv_cache_spec_sliding_window is not None:
            stored.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
        for tokens in event.lookahead_token_ids or ():
            stored.lookahead_token_ids.add().token_ids.extend(tokens)
        for keys in event.extra_keys or ():
            entry = stored.extra_keys.add()
            if keys is not None:
                entry.present = True
                if all(type(k) is str for k in keys):
                    entry.keys.extend(keys)  # type: ignore[arg-type]
                else:
                    for k in keys:
                        _extra_key_to_pb(k, entry.values.add())
    else:
        assert isinstance(event, AllBlocksCleared)
        message.all_blocks_cleared.SetInParent()


def _extra_key_to_pb(key: object, out: pb.EventExtraKey) -> None:
    if isinstance(key, str):
        out.text = key
    elif isinstance(key, bytes):
        out.digest = key
    elif isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int):
        out.mm.identifier, out.mm.offset = key
    else:
        raise WireError(f"an event extra key kvcoord cannot send: {key!r}")


def _extra_keys_from_pb(entry: pb.EventExtraKeys) -> tuple[object, ...] | None:
    if not entry.present:
        return None
    if not entry.values:
        return tuple(entry.keys)
    out: list[object] = []
    for k in entry.values:
        kind = k.WhichOneof("key")
        if kind == "text":
            out.append(k.text)
        elif kind == "digest":
            out.append(k.digest)
        elif kind == "mm":
            out.append((k.mm.identifier, k.mm.offset))
        else:
            raise WireError("an event extra key with no value")
    return tuple(out)


def event_from_pb(message: pb.KVEvent) -> KVCacheEvent:
    """A KVEvent as the engine's event (the cache namespace never travels: b"").

    Raises:
        WireError: no event is set.
    """
    kind = message.WhichOneof("event")
    if kind == "block_stored":
        s = message.block_stored
        return BlockStored(
            block_hashes=tuple(s.block_hashes),
            parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
            token_ids=tuple(s.token_ids),
            block_size=s.block_size,
            lora_id=s.lora_id if s.HasField("lora_id") else None,
            lora_name=s.lora_name if s.HasField("lora_name") else None,
            medium=s.medium,
            # vllm-0.33's fields (None when not sent, as a 0.16 pool's events)
            extra_keys=tuple(_extra_keys_from_pb(k) for k in s.extra_keys) if s.extra_keys else None,
            group_idx=s.group_idx if s.HasField("group_idx") else None,
            kv_cache_spec_kind=s.kv_cache_spec_kind if s.HasField("kv_cache_spec_kind") else None,
            kv_cache_spec_sliding_window=(
                s.kv_cache_spec_sliding_window if s.HasField("kv_cache_spec_sliding_window") else None
            ),
            lookahead_token_ids=tuple(tuple(t.token_ids) for t in s.lookahead_token_ids)
            if s.lookahead_token_ids
            else None,
        )
    if kind == "block_removed":
        r = message.block_removed
        return BlockRemoved(
            block_hashes=tuple(r.block_hashes),
            medium=r.medium,
            group_idx=r.group_idx if r.HasField("group_idx") else None,
        )
    if kind == "all_blocks_cleared":
        return AllBlocksCleared()
    raise WireError("KVEvent has no event set")


def events_from_pb(messages: Iterable[pb.KVEvent]) -> list[KVCacheEvent]:
    return [event_from_pb(m) for m in messages]


def events_message_digest(holder: pb.StepResponse) -> bytes:
    """SHA-256 of ``holder`` serialized: a StepResponse in which only ``events`` is set."""
    return hashlib.sha256(holder.SerializeToString()).digest()


def events_digest(events: Iterable[KVCacheEvent]) -> bytes:
    """The events digest of engine events (StepResponse.events_sha256): SHA-256 of a
    StepResponse holding only these events, serialized."""
    holder = pb.StepResponse()
    add_events(holder.events, events)
    return events_message_digest(holder)
