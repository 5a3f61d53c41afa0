"""Why an engine cannot run vLLM 0.33's scheduler on kvcoord (:func:`unsupported_033`):
each layout or option the ``vllm-0.33`` profile does not reproduce, named, so that the
plug-in refuses it at start instead of answering other than vLLM would. The mamba and
KV-connector rules are their modules' (:mod:`.vllm033_mamba`, :mod:`.vllm033_connector`);
``docs/semantics-notes.md`` lists each refusal with why."""

from __future__ import annotations

import math
from typing import Any

from .vllm033_connector import connector_refusal_033
from .vllm033_mamba import partial_hits_033, shared_prefix_checkpoint_033, uncached_mamba_hybrid

__all__ = ["eagle_drop_refusal_033", "eagle_drops_033", "unsupported_033"]


def unsupported_mla_033(i: int, spec: Any) -> str | None:
    """Why KV cache group ``i``, an ``MLAAttentionSpec``, is not taken (``None``: it is,
    as full attention, which vLLM 0.33's FullAttentionManager makes it). Its padding
    (``alignment``) and kernel fields change no block id; what changes allocation or
    grouping is refused by name."""
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    if tokens_per_state != 1:
        return (
            f"KV cache group {i} is MLA storing one state per {tokens_per_state} tokens "
            "(tokens_per_state, DeepseekV4 compression): not supported by the vllm-0.33 profile"
        )
    if getattr(spec, "model_version", None) is not None:
        return (
            f"KV cache group {i} is MLA of model_version {spec.model_version!r} (DeepseekV4 "
            "fields): not supported by the vllm-0.33 profile"
        )
    role = getattr(getattr(spec, "cache_role", None), "value", "sparse")
    if role != "sparse" or getattr(spec, "is_index_group_leader", False):
        return (
            f"KV cache group {i} is sparse MLA with an indexer (cache_role {role!r}, "
            f"is_index_group_leader {bool(getattr(spec, 'is_index_group_leader', False))}: "
            "DeepSeek V3.2): not checked against vLLM 0.33, not supported by the vllm-0.33 profile"
        )
    return None


def unsupported_033(kv_cache_config: Any, vllm_config: Any, hash_block_size: int) -> str | None:
    """Why an engine with these configs cannot run its vLLM 0.33 scheduler on kvcoord
    (``None``: it can)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    parallel = getattr(vllm_config, "parallel_config", None)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        # (0.33 scales a sharded group's block by the DCP size for its lookups and the
        # scheduler block size; the pool's groups keep the per-rank size)
        return (
            f"decode / prefill context parallelism ({dcp} / {pcp}): vLLM 0.33 scales each "
            "sharded group's block by it, which the vllm-0.33 profile does not model"
        )
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if getattr(spec, "sink_len", None):
            return (
                f"KV cache group {i} has attention sinks ({type(spec).__name__}): vLLM 0.33.0 itself "
                "cannot build its sink manager (SinkFullAttentionManager does not take the "
                "needs_kv_cache_zeroing argument its coordinator passes), so there is no 0.33 "
                "behaviour for the vllm-0.33 profile to reproduce"
            )
        # (exact types: MLA's own subclasses and the other ones are not taken)
        if type(spec) is MLAAttentionSpec:
            why = unsupported_mla_033(i, spec)
            if why is not None:
                return why
        elif type(spec) is CrossAttentionSpec:
            return (
                f"KV cache group {i} is CrossAttentionSpec (an encoder-decoder model): kvcoord's "
                "vllm-0.33 plug-in has not been checked against vLLM 0.33's scheduler with encoder "
                "inputs (cross-attention blocks for num_encoder_tokens, the encoder budget), so it "
                "does not take it"
            )
        elif type(spec) not in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec):
            return (
                f"KV cache group {i} is {type(spec).__name__}: kvcoord's vllm-0.33 plug-in supports "
                "full attention, MLA, sliding window, chunked local attention and mamba only"
            )
        # (mamba prefill checkpoint blocks and shared-prefix checkpoints run: the pool
        # models them; what they are refused beside is partial_hits_033's)
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    partial = partial_hits_033(groups, vllm_config, hash_block_size)
    if partial:
        return partial
    if shared_prefix_checkpoint_033(groups, vllm_config, hash_block_size) and (
        vllm_config.speculative_config is not None
        or any(getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) for g in groups)
    ):
        # (each runs beside fine-grained hits; with the junction's key too, untested against vLLM)
        return (
            "mamba shared-prefix checkpoints (enable_mamba_shared_prefix_checkpoint, on with an "
            "EAGLE group and fine-grained hits) beside drafts or mamba prefill checkpoint blocks: "
            "not modelled together by the vllm-0.33 profile"
        )
    if partial is not None or (
        len(sizes) > 1 and uncached_mamba_hybrid(groups, vllm_config, hash_block_size)
    ):
        # fine-grained hits (one size), or nothing hashed: one scheduler block, their LCM
        sizes = set()
    if len(sizes) > 1 and any(hasattr(g.kv_cache_spec, "mamba_cache_mode") for g in groups):
        return (
            f"KV cache groups of several block sizes {sorted(sizes)} beside a mamba group with "
            "hashes: not supported by the vllm-0.33 profile"
        )
    if sizes and (hash_block_size not in sizes or any(size % hash_block_size for size in sizes)):
        # (several sizes run: hashes of the smallest, hits and caching at their LCM)
        return (
            f"hash_block_size {hash_block_size} is not the smallest block size of {sorted(sizes)}: "
            "fine-grained (partial) prefix hits are not supported"
        )
    retention = getattr(kv_cache_config, "prefix_cache_retention_interval", 0)
    if retention and any(hasattr(g.kv_cache_spec, "mamba_cache_mode") for g in groups):
        # (periodic sliding-window retention is the pool's: window_block_mask)
        return (
            f"prefix_cache_retention_interval {retention} beside a mamba group: periodic mamba "
            "state checkpoints are not supported by the vllm-0.33 profile"
        )
    # (a KV consumer beside mamba with overlapping steps runs: deferred frees, the
    # mamba state dropped by the pool's free, its pending hand-offs at the take)
    why = connector_refusal_033(kv_cache_config, vllm_config)
    if why is not None:
        return why
    prefill_lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    hash_lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
    if (
        prefill_lookahead > 1
        and prefill_lookahead != hash_lookahead
        and vllm_config.cache_config.enable_prefix_caching
    ):
        # (the pool's re-prefillable tail is its look-ahead L - 1: 0.33's is the prefill
        # look-ahead's, which only look-ahead hashes carry)
        return (
            f"multi-module MTP (a prefill look-ahead of {prefill_lookahead} tokens) with block "
            f"hashes of {hash_lookahead} look-ahead tokens (a KV connector keeps the legacy "
            "hashes): its re-prefillable tail is not supported by the vllm-0.33 profile"
        )
    return eagle_drop_refusal_033(groups, vllm_config)


def eagle_drops_033(vllm_config: Any) -> bool:
    """Whether vLLM 0.33's Scheduler runs its manager with EAGLE's trailing-block drop
    (``use_eagle``): EAGLE/EAGLE3/MTP drafts without look-ahead block hashes (a KV
    connector, ``disable_lookahead_block_hashes`` or prefix caching off)."""
    spec = vllm_config.speculative_config
    return bool(
        spec is not None
        and spec.use_eagle_block_drop()
        and not getattr(vllm_config, "num_hash_lookahead_tokens", 0)
    )


def eagle_drop_refusal_033(groups: Any, vllm_config: Any) -> str | None:
    """What of EAGLE's trailing-block drop the vllm-0.33 profile does not reproduce
    (``None``: all of it, or no drop)."""
    if not eagle_drops_033(vllm_config):
        return None
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    specs = [g.kv_cache_spec for g in groups]
    for i, spec in enumerate(specs):
        if hasattr(spec, "mamba_cache_mode") and (
            caching or bool(getattr(spec, "num_prefill_checkpoint_blocks", 0))
        ):
            return (
                f"EAGLE/MTP with the trailing-block drop (look-ahead block hashes off: a KV connector "
                f"or disable_lookahead_block_hashes) beside mamba group {i}: 0.33 then moves the mamba "
                "checkpoints back a block, which the vllm-0.33 profile does not reproduce"
            )
    if caching and int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0) > 1:
        return (
            "multi-module MTP with the trailing-block drop and prefix caching: 0.33 keeps the "
            "re-prefilled tokens out of caching, which the vllm-0.33 profile does not reproduce"
        )
    flagged = [i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)] or range(len(groups))
    lcm = math.lcm(*(int(s.block_size) for s in specs)) if specs else 0
    for i, spec in enumerate(specs):
        # (a spec group drops when any of its groups is flagged)
        if not caching or not any(j in flagged for j, other in enumerate(specs) if other == spec):
            continue
        kind = type(spec).__name__
        if kind == "SlidingWindowSpec" and len(specs) > 1 and int(spec.block_size) != lcm:
            return (
                f"EAGLE/MTP with the trailing-block drop on sliding-window group {i} of block size "
                f"{spec.block_size} other than the LCM {lcm}: not supported by the vllm-0.33 profile"
            )
        if kind == "ChunkedLocalAttentionSpec":
            return f"EAGLE/MTP with the trailing-block drop on chunked-local group {i}: vLLM 0.33 asserts it away"
    return None
