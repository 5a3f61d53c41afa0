"""A pool's state as a value of its own: plain lists, ints, bytes and strings.

:func:`export_state` reads a :class:`~kvcoord.engine.pool.KVCachePool` into a dict
of plain values (no engine object, no class name, nothing pickled);
:func:`import_state` builds a pool of the same configuration in exactly that state.
The pair is pure (no I/O): the server's snapshots encode the value (recovery.py), and
anything that holds the configuration can load a pool from it.

What is kept is what decides every later answer: which blocks exist (blocks are
created lazily, in id order), each block's reference count and cached key, the free
queue's used part in order (the never-used run is a counter), the prefix-cache map in
insertion order per group, every manager's block lists, every request's fields, the
cache namespaces, statistics and counters, and events not yet taken. Dead entries of
the free queue are not kept: the imported queue is compacted, which no answer can tell
(only the live order is observable).

Bump :data:`STATE_VERSION` whenever the meaning of a field changes; readers refuse
another version.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from .block_pool import BlockHashToBlockMap
from .blocks import KVCacheBlock
from .config import KVCacheConfig
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .extra_keys import ExtraKeySources, MultiModalItem
from .managers.mamba import MambaManager
from .managers.mamba033 import MambaManager033
from .managers.partial import CopyOnWrite, PartialMambaManager
from .pool import KVCachePool
from .request import LoRA, Request
from .reservations import Reservation, ReservationCounters
from .results import CacheHit
from .stats import LookupCounters, PrefixCacheStats
from .types import BlockId

__all__ = [
    "STATE_VERSION",
    "StateError",
    "event_from_value",
    "event_to_value",
    "export_state",
    "import_state",
]

#: the version of the value :func:`export_state` returns
STATE_VERSION = 3


class StateError(ValueError):
    """A state value that this engine cannot import (another version, or inconsistent)."""


def export_state(pool: KVCachePool) -> dict[str, Any]:
    """The pool's whole state as plain values (see the module docstring).

    Reads only; the value shares no mutable object with the pool, except that token
    id and hash lists are copied shallowly (their elements are immutable).
    """
    bp = pool.block_pool
    queue = bp.free_block_queue
    created = queue.next_fresh
    blocks = bp.blocks
    cache = bp.cached_block_hash_to_block
    managers = []
    for m in pool.managers:
        entry: dict[str, Any] = {
            "blocks": [(rid, [b.block_id for b in bl]) for rid, bl in m.req_to_blocks.items()],
            "cached": list(m.num_cached_block.items()),
        }
        if isinstance(m, MambaManager):
            entry["mamba_allocated"] = sorted(m.allocated_block_reqs)
            entry["mamba_last_state"] = list(m.last_state_block_idx.items())
        if isinstance(m, MambaManager033):
            entry["mamba_retired"] = list(m.num_retired_blocks.items())
            entry["mamba_cached_this_step"] = [list(k) for k in m.cached_this_step]
            entry["mamba_offloads"] = [[r, g, b.block_id, t] for r, g, b, t in m.pending_offloads]
            # prefill checkpoints planned, not yet keyed (cache_blocks may come later)
            entry["mamba_checkpoints"] = [[r, pos, i] for r, (pos, i) in m.checkpoints.items()]
        if isinstance(m, CopyOnWrite):  # vllm-0.33 fine-grained hits
            entry["cow_tails"] = [[r, i, b.block_id] for r, (i, b) in m.partial_hit_reqs.items()]
            entry["cow_pending"] = [[a.block_id, b.block_id] for a, b in m.pending_cow]
        if isinstance(m, PartialMambaManager):
            entry["cow_producers"] = [[r, b.block_id, t] for r, (b, t) in m.producer_tails.items()]
        managers.append(entry)
    requests = []
    for r in pool.requests.values():
        requests.append(
            [
                r.request_id,
                list(r.all_token_ids),
                list(r.block_hashes),
                r.num_computed_tokens,
                r.num_preemptions,
                None if r.lora is None else [r.lora.adapter_id, r.lora.name],
                r.skip_reading_prefix_cache,
                None if r.last_hit is None else [[list(g) for g in r.last_hit[0]], r.last_hit[1]],
                r.cache_prefix,
                r.cache_salt,
                r.num_prompt_tokens,
                r.shared_prefix_boundary,
                _sources_to_value(r.extra_key_sources),
                r.kv_cache_report_full,
            ]
        )
    stats = pool.prefix_cache_stats
    counters = pool.lookup_counters
    return {
        "version": STATE_VERSION,
        "num_blocks": bp.num_blocks,
        "created": created,
        "ref_cnt": [b.ref_cnt for b in blocks[:created]],
        # (block id, key, group, client hash or None) of every cached block, by id
        "cached_blocks": [
            (b.block_id, b.cached_hash, b.cached_group, b.event_hash)
            for b in blocks[:created]
            if b.cached_hash is not None
        ],
        # the vllm-0.33 profile's prepended blocks (ahead of the never-used run), then
        # the used part behind it
        "free_front": queue.front_ids(),
        "free_used": queue.head_ids()[len(queue.front_ids()) + bp.num_blocks - created :],
        "hash_first": [list(first.items()) for first in cache.first],
        "hash_more": [[(h, list(ids)) for h, ids in more.items()] for more in cache.more],
        "managers": managers,
        "requests": requests,
        "namespaces": list(pool.cache_namespaces.items()),
        "prefix_cache_stats": None if stats is None else dataclasses.astuple(stats),
        "lookup_counters": [
            counters.lookups,
            counters.queries,
            counters.hits,
            counters.short_lookups,
            list(counters.group_hit_tokens),
        ],
        "counters": [bp.num_evictions, bp.hash_epoch, bp.num_allocated, bp.num_freed, pool.num_refusals],
        "evict_blocks_called": pool.evict_blocks_called,
        # vllm-0.33 partial-tail entries: a block's keys beyond its primary one, and the
        # token counts of primary keys that are partial entries
        "secondary_keys": [(bid, [list(k) for k in keys]) for bid, keys in bp.secondary_keys.items()],
        "partial_tokens": list(bp.partial_tokens.items()),
        # vllm-0.33 fine-grained hits: copy blocks taken and not released (block, count)
        "retained": sorted(pool.retained.items()),
        "pending_events": [event_to_value(e) for e in bp.kv_event_queue],
        # routers' reservations (their references are in ref_cnt above), oldest first
        "reservations": [
            [
                r.reservation_id,
                [list(g) for g in r.hit.block_ids],
                r.hit.num_tokens,
                [list(g) for g in r.held],
                r.namespace_prefix,
                r.last_hash,
                r.num_hashes,
                r.num_tokens,
            ]
            for r in pool.reservations.live.values()
        ],
        "reservation_counters": list(dataclasses.astuple(pool.reservations.counters)),
        # vllm-0.33 with mamba: block ids taken for the worker to zero, not yet taken
        "new_block_ids": [list(ids) for ids in pool.pending_new_block_ids],
    }


def import_state(config: KVCacheConfig, state: dict[str, Any]) -> KVCachePool:
    """A new pool of ``config`` in the state :func:`export_state` returned.

    Raises:
        StateError: another state version, or a value that does not fit ``config``.
    """
    if state.get("version") != STATE_VERSION:
        raise StateError(f"pool state version {state.get('version')!r}, this engine reads {STATE_VERSION}")
    pool = KVCachePool(config)
    bp = pool.block_pool
    if state["num_blocks"] != bp.num_blocks:
        raise StateError(f"the state has {state['num_blocks']} blocks, the configuration {bp.num_blocks}")
    created = state["created"]
    ref_cnts = state["ref_cnt"]
    blocks = bp.blocks
    if len(ref_cnts) != created or created < len(blocks) or created > bp.num_blocks:
        raise StateError(f"the state's {created} created blocks do not fit its columns")
    # Blocks the constructor made (the null block, sink blocks) stay the same objects:
    # managers hold them.
    blocks.extend(KVCacheBlock(BlockId(i)) for i in range(len(blocks), created))
    for block, ref_cnt in zip(blocks, ref_cnts, strict=True):
        block.ref_cnt = ref_cnt
    for block_id, key, group, event_hash in state["cached_blocks"]:
        block = blocks[block_id]
        block.cached_hash = key
        block.cached_group = group
        block.event_hash = event_hash
    bp.free_block_queue.load(
        created, [blocks[i] for i in state["free_used"]], [blocks[i] for i in state.get("free_front", ())]
    )
    if len(state["hash_first"]) != len(bp.cached_block_hash_to_block.first):
        raise StateError("the state's prefix-cache map has another number of groups")
    # a new map (as a reset makes): whatever watched the old one's keys is not told
    # of these, and sees the map replaced
    cache = bp.cached_block_hash_to_block = BlockHashToBlockMap(len(state["hash_first"]))
    for gid, pairs in enumerate(state["hash_first"]):
        cache.first[gid] = dict(pairs)
        cache.more[gid] = {h: dict.fromkeys(ids) for h, ids in state["hash_more"][gid]}
    if len(state["managers"]) != len(pool.managers):
        raise StateError("the state has another number of KV cache groups")
    for m, entry in zip(pool.managers, state["managers"], strict=True):
        m.req_to_blocks = {rid: [blocks[i] for i in ids] for rid, ids in entry["blocks"]}
        m.num_cached_block = dict(entry["cached"])
        if isinstance(m, MambaManager):
            m.allocated_block_reqs = set(entry.get("mamba_allocated", ()))
            m.last_state_block_idx = dict(entry.get("mamba_last_state", ()))
        if isinstance(m, MambaManager033):
            m.num_retired_blocks = dict(entry.get("mamba_retired", ()))
            m.cached_this_step = {(h, g) for h, g in entry.get("mamba_cached_this_step", ())}
            m.pending_offloads = [(r, g, blocks[b], t) for r, g, b, t in entry.get("mamba_offloads", ())]
            m.checkpoints = {r: (pos, i) for r, pos, i in entry.get("mamba_checkpoints", ())}
        if isinstance(m, CopyOnWrite):
            m.partial_hit_reqs = {r: (i, blocks[b]) for r, i, b in entry.get("cow_tails", ())}
            m.pending_cow = [(blocks[a], blocks[b]) for a, b in entry.get("cow_pending", ())]
        if isinstance(m, PartialMambaManager):
            m.producer_tails = {r: (blocks[b], t) for r, b, t in entry.get("cow_producers", ())}
    pool.retained = Counter(dict(state.get("retained", ())))
    table = pool.requests  # shared with the request table: filled in place
    for entry in state["requests"]:
        rid, tokens, hashes, computed, preemptions, lora, skip, last_hit, prefix = entry[:9]
        # absent from older kvcoord's states (only vllm-0.33 pools read the last two)
        # salt, prompt length, shared-prefix boundary, extra-key sources, report mode
        defaults = [None, len(tokens), 0, None, False]
        salt, num_prompt, junction, sources, report_full = list(entry[9:14]) + defaults[len(entry[9:14]) :]
        table[rid] = Request(
            rid,
            list(tokens),
            list(hashes),
            computed,
            preemptions,
            None if lora is None else LoRA(lora[0], lora[1]),
            skip,
            None if last_hit is None else (tuple(tuple(g) for g in last_hit[0]), last_hit[1]),
            prefix,
            salt,
            num_prompt,
            junction,
            _sources_from_value(sources),
            kv_cache_report_full=report_full,
        )
    pool.request_table.cache_namespaces.update(dict(state["namespaces"]))
    stats = state["prefix_cache_stats"]
    pool.prefix_cache_stats = None if stats is None else PrefixCacheStats(*stats)
    lookups, queries, hits, short, group_hits = state["lookup_counters"]
    pool.hits.lookup_counters = LookupCounters(lookups, queries, hits, short, list(group_hits))
    bp.num_evictions, bp.hash_epoch, bp.num_allocated, bp.num_freed, pool.num_refusals = state["counters"]
    pool.evict_blocks_called = state["evict_blocks_called"]
    bp.secondary_keys = {bid: [tuple(k) for k in keys] for bid, keys in state.get("secondary_keys", ())}
    bp.partial_tokens = dict(state.get("partial_tokens", ()))
    bp.kv_event_queue = [event_from_value(v) for v in state["pending_events"]]
    live = pool.reservations.live
    for rid, hit_ids, hit_tokens, held, prefix, last_hash, num_hashes, num_tokens in state["reservations"]:
        hit = CacheHit(tuple(tuple(g) for g in hit_ids), hit_tokens)
        held_ids = tuple(tuple(g) for g in held)
        live[rid] = Reservation(rid, hit, held_ids, prefix, last_hash, num_hashes, num_tokens)
    pool.reservations.counters = ReservationCounters(*state["reservation_counters"])
    for gid, ids in enumerate(state.get("new_block_ids", ())):
        pool.pending_new_block_ids[gid] = list(ids)
    return pool


def _sources_to_value(sources: ExtraKeySources | None) -> list[Any] | None:
    if sources is None:
        return None
    digests = None if sources.embeds_digests is None else list(sources.embeds_digests)
    return [[[m.identifier, m.offset, m.length] for m in sources.mm_items], digests]


def _sources_from_value(value: list[Any] | None) -> ExtraKeySources | None:
    if value is None:
        return None
    items, digests = value
    return ExtraKeySources(
        tuple(MultiModalItem(i, o, n) for i, o, n in items), None if digests is None else tuple(digests)
    )


def _event_keys(keys: list[Any]) -> tuple[Any, ...]:
    """One block's untagged keys read back (a multimodal key is a pair)."""
    return tuple(tuple(k) if isinstance(k, list) else k for k in keys)


def event_to_value(event: KVCacheEvent) -> list[Any]:
    """A KV event as plain values (the first says which kind)."""
    if isinstance(event, BlockStored):
        return [
            "stored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.lora_name,
            event.medium,
            event.cache_prefix,
            None if event.extra_keys is None else [None if k is None else list(k) for k in event.extra_keys],
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            None if event.lookahead_token_ids is None else [list(t) for t in event.lookahead_token_ids],
        ]
    if isinstance(event, BlockRemoved):
        return ["removed", list(event.block_hashes), event.medium, event.cache_prefix, event.group_idx]
    return ["cleared"]


def event_from_value(value: list[Any]) -> KVCacheEvent:
    """The event :func:`event_to_value` made.

    Raises:
        StateError: an unknown kind.
    """
    kind = value[0]
    if kind == "stored":
        hashes, parent, tokens, size, lora_id, lora_name, medium, prefix = value[1:9]
        # vllm-0.33 fields (absent from states of older kvcoord versions)
        extra, group, spec_kind, window, lookahead = (list(value[9:14]) + [None] * 5)[:5]
        return BlockStored(
            tuple(hashes), parent, tuple(tokens), size, lora_id, lora_name, medium, prefix,
            None if extra is None else tuple(None if k is None else _event_keys(k) for k in extra),
            group, spec_kind, window,
            None if lookahead is None else tuple(tuple(t) for t in lookahead),
        )  # fmt: skip
    if kind == "removed":
        return BlockRemoved(tuple(value[1]), value[2], value[3], value[4] if len(value) > 4 else None)
    if kind == "cleared":
        return AllBlocksCleared()
    raise StateError(f"unknown event kind {kind!r}")
