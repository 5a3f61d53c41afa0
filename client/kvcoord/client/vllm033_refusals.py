"""Why an engine cannot run vLLM 0.33's scheduler on kvcoord (:func:`unsupported_033`):
each layout or option the ``vllm-0.33`` profile does not reproduce, named, so that the
plug-in refuses it at start instead of answering other than vLLM would. The mamba and
KV-connector rules are their modules' (:mod:`.vllm033_mamba`, :mod:`.vllm033_connector`);
``docs/semantics-notes.md`` lists each refusal with why."""

from __future__ import annotations

import math
from typing import Any

from .vllm033_connector import connector_refusal_033
from .vllm033_mamba import partial_hits_033, uncached_mamba_hybrid, unsupported_mamba_033

__all__ = ["eagle_drop_refusal_033", "eagle_drops_033", "unsupported_033"]


def unsupported_033(kv_cache_config: Any, vllm_config: Any, hash_block_size: int) -> str | None:
    """Why an engine with these configs cannot run its vLLM 0.33 scheduler on kvcoord
    (``None``: it can)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if getattr(spec, "sink_len", None):
            return (
                f"KV cache group {i} has attention sinks ({type(spec).__name__}): vLLM 0.33.0 itself "
                "cannot build its sink manager (SinkFullAttentionManager does not take the "
                "needs_kv_cache_zeroing argument its coordinator passes), so there is no 0.33 "
                "behaviour for the vllm-0.33 profile to reproduce"
            )
        # (exact types: MLA and the other subclasses are not taken)
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec):
            return (
                f"KV cache group {i} is {type(spec).__name__}: kvcoord's vllm-0.33 plug-in supports "
                "full attention, sliding window, chunked local attention and mamba only "
                "(cross-attention is not on the wire yet)"
            )
        why = unsupported_mamba_033(i, spec, vllm_config)
        if why is not None:
            return why
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    partial = partial_hits_033(groups, vllm_config, hash_block_size)
    if partial:
        return partial
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
