"""vLLM 0.33's partial-tail entries: a block cached under more than one key, one of
them possibly partial (full-attention groups whose block is larger than the hash
block, fine-grained hits), evicted all at once, its keys moved by copy-on-write."""

from __future__ import annotations

import dataclasses

from .block_hash_map import BlockHashToBlockMap
from .blocks import KVCacheBlock
from .events import BlockStored, KVCacheEvent, block_removed
from .hash_list import NAMESPACE_PREFIX_BYTES, request_keys
from .request import Request


class PartialKeys:
    """:class:`~kvcoord.engine.block_pool.BlockPool`'s multi-key operations (its
    ``multi_key_blocks`` pools only)."""

    # the block pool's fields these read and change (:class:`BlockPool`)
    hash_block_size: int
    enable_kv_cache_events: bool
    cached_block_hash_to_block: BlockHashToBlockMap
    kv_event_queue: list[KVCacheEvent]
    num_evictions: int
    hash_epoch: int
    group_event_fields: tuple[tuple[str, int | None], ...] | None
    num_hash_lookahead_tokens: int
    secondary_keys: dict[int, list[tuple[bytes, int, bytes | None]]]
    partial_tokens: dict[int, int]

    def evict_all_keys(self, block: KVCacheBlock) -> bool:
        """vllm-0.33 with partial-tail entries: forget every key of ``block`` (its
        primary one first), a BlockRemoved per key."""
        block_hash = block.cached_hash
        if block_hash is None:
            return False
        bid = block.block_id
        keys = [(block_hash, block.cached_group, block.event_hash), *self.secondary_keys.pop(bid, ())]
        self.partial_tokens.pop(bid, None)
        block.cached_hash = None
        block.event_hash = None
        cache = self.cached_block_hash_to_block
        for key, group, original in keys:
            if not cache.pop(key, group, bid):
                continue
            self.num_evictions += 1
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(
                    block_removed(key, b"", group)
                    if original is None
                    else block_removed(original, key[:NAMESPACE_PREFIX_BYTES], group)
                )
        self.hash_epoch += 1
        return True

    def has_key(self, block: KVCacheBlock, key: bytes, group_id: int) -> bool:
        """Whether ``block`` is cached under ``key`` for the group, as its primary key or
        (vllm-0.33 partial entries) one more."""
        if block.cached_hash == key and block.cached_group == group_id:
            return True
        return any(k == key and g == group_id for k, g, _ in self.secondary_keys.get(block.block_id, ()))

    def move_block_hashes(self, source: KVCacheBlock, target: KVCacheBlock) -> None:
        """vLLM 0.33's copy-on-write for a request still writing ``source``: every key
        of ``source`` (primary first, with its partial token count) now names
        ``target``, which holds none; no event (the entries stay live)."""
        assert target.cached_hash is None and target.block_id not in self.secondary_keys
        if source.cached_hash is None:
            return
        sid, tid = source.block_id, target.block_id
        keys = [
            (source.cached_hash, source.cached_group, source.event_hash),
            *self.secondary_keys.pop(sid, ()),
        ]
        tokens = self.partial_tokens.pop(sid, None)
        source.cached_hash = None
        source.event_hash = None
        cache = self.cached_block_hash_to_block
        for key, group, _ in keys:
            cache.pop(key, group, sid)
            cache.insert(key, group, tid)
        target.cached_hash, target.cached_group, target.event_hash = keys[0]
        if len(keys) > 1:
            self.secondary_keys[tid] = keys[1:]
        if tokens is not None:
            self.partial_tokens[tid] = tokens
        self.hash_epoch += 1  # a hit naming the source is stale now

    def cache_partial_block(
        self, request: Request, block: KVCacheBlock, num_tokens: int, group_id: int
    ) -> None:
        """vLLM 0.33's partial-tail entry: make ``block`` reachable under the request's
        hash at ``num_tokens`` (a multiple of the hash block inside the block), as its
        primary key when it has none, else as one more key. Its BlockStored covers the
        hash block ending there."""
        if block.is_null:
            return
        n = num_tokens // self.hash_block_size
        original = request.block_hashes[n - 1]
        key = request_keys(request.block_hashes[n - 1 : n], request.cache_prefix)[0]
        bid = block.block_id
        if self.has_key(block, key, group_id):
            return
        partial = self.partial_tokens.get(bid)
        if block.cached_hash is not None and partial is not None and partial < num_tokens:
            self.evict_all_keys(block)  # a shorter partial entry gives way
        if block.cached_hash is None:
            block.cached_hash = key
            block.cached_group = group_id
            block.event_hash = original if request.cache_prefix else None
            self.partial_tokens[bid] = num_tokens
        else:
            self.secondary_keys.setdefault(bid, []).append(
                (key, group_id, original if request.cache_prefix else None)
            )
        self.cached_block_hash_to_block.insert(key, group_id, bid)
        if not self.enable_kv_cache_events:
            return
        start = (n - 1) * self.hash_block_size
        lora = request.lora
        event = BlockStored(
            block_hashes=(original,),
            parent_block_hash=request.block_hashes[n - 2] if n > 1 else None,
            token_ids=tuple(request.all_token_ids[start:num_tokens]),
            block_size=num_tokens - start,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            cache_prefix=request.cache_prefix,
        )
        if self.group_event_fields is not None:
            kind, window = self.group_event_fields[group_id]
            event = dataclasses.replace(
                event,
                extra_keys=(
                    request.event_extra_keys(
                        start // self.hash_block_size, self.hash_block_size, self.num_hash_lookahead_tokens
                    ),
                ),
                group_idx=group_id,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                lookahead_token_ids=(
                    (tuple(request.all_token_ids[num_tokens : num_tokens + self.num_hash_lookahead_tokens]),)
                    if self.num_hash_lookahead_tokens
                    else None
                ),
            )
        self.kv_event_queue.append(event)
