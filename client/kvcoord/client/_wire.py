"""Engine values <-> messages, for the mirror (private).

A stopgap: the shared ``kvcoord.wire`` module (written at the same time by another
change) owns these conversions for client and server alike; once it lands, the mirror
imports them from there and this module goes. Each is what the server's conversions
make, so the mirror's events digest and statistics compare equal to the server's.
"""

from __future__ import annotations

from kvcoord.engine import (
    AttentionSpec,
    BlockRemoved,
    BlockStored,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheEvent,
    MambaCacheMode,
    MambaSpec,
    PrefixCacheStats,
    SlidingWindowSpec,
)
from kvcoord.v1 import allocator_pb2 as pb

from .hashing import HASH_LENGTHS

__all__ = ["engine_config", "fill_event", "stats_to_pb"]

#: the server's max_model_len when a pool sets none (its engine's "unlimited")
_UNLIMITED_MODEL_LEN = 1 << 31


def stats_to_pb(stats: PrefixCacheStats) -> pb.PrefixCacheStats:
    return pb.PrefixCacheStats(
        reset=stats.reset,
        requests=stats.requests,
        queries=stats.queries,
        hits=stats.hits,
        preempted_requests=stats.preempted_requests,
        preempted_queries=stats.preempted_queries,
        preempted_hits=stats.preempted_hits,
    )


def fill_event(message: pb.KVEvent, event: KVCacheEvent) -> None:
    """``message`` made the KV event the server sends for ``event``."""
    if isinstance(event, BlockStored):
        out = message.block_stored
        out.block_hashes.extend(event.block_hashes)
        out.token_ids.extend(event.token_ids)
        out.block_size = event.block_size
        out.medium = event.medium
        if event.parent_block_hash is not None:
            out.parent_block_hash = event.parent_block_hash
        if event.lora_id is not None:
            out.lora_id = event.lora_id
        if event.lora_name is not None:
            out.lora_name = event.lora_name
    elif isinstance(event, BlockRemoved):
        out_removed = message.block_removed
        out_removed.block_hashes.extend(event.block_hashes)
        out_removed.medium = event.medium
    else:
        message.all_blocks_cleared.SetInParent()


def engine_config(cfg: pb.PoolConfig) -> KVCacheConfig:
    """The engine configuration the server builds for a pool of ``cfg`` (a pool the
    server made, so valid: nothing is checked here but what the engine checks)."""
    return KVCacheConfig(
        num_blocks=cfg.num_blocks,
        groups=tuple(_spec(g) for g in cfg.groups),
        hash_block_size=cfg.hash_block_size,
        enable_caching=cfg.enable_caching,
        use_eagle=cfg.use_eagle,
        enable_kv_cache_events=cfg.enable_kv_cache_events,
        log_stats=cfg.log_stats if cfg.HasField("log_stats") else True,
        max_model_len=cfg.max_model_len or _UNLIMITED_MODEL_LEN,
        hash_length=HASH_LENGTHS.get(cfg.hash_algo) if cfg.enable_caching else None,
    )


def _spec(group: pb.KVCacheGroupSpec) -> AttentionSpec:
    kind = group.WhichOneof("spec")
    if kind == "sliding_window":
        w = group.sliding_window
        return SlidingWindowSpec(w.block_size, w.sliding_window, w.num_kv_heads or 1, w.head_size or 1,
                                 w.dtype or "auto")  # fmt: skip
    if kind == "chunked_local":
        c = group.chunked_local
        return ChunkedLocalAttentionSpec(c.block_size, c.attention_chunk_size, c.num_kv_heads or 1,
                                         c.head_size or 1, c.dtype or "auto")  # fmt: skip
    if kind == "mamba":
        m = group.mamba
        shapes = (tuple(m.shape_dims),) if m.shape_dims else ()
        return MambaSpec(m.block_size, MambaCacheMode(m.mamba_cache_mode or "none"), m.num_speculative_blocks,
                         shapes, tuple(m.dtypes))  # fmt: skip
    if kind == "cross_attention":
        x = group.cross_attention
        return CrossAttentionSpec(x.block_size, x.num_kv_heads or 1, x.head_size or 1, x.dtype or "auto")
    if kind == "full":
        f = group.full
        return FullAttentionSpec(f.block_size, f.num_kv_heads or 1, f.head_size or 1, f.dtype or "auto",
                                 f.use_mla, f.sink_len or None)  # fmt: skip
    raise ValueError(f"a KV cache group of an unknown kind {kind!r}")
