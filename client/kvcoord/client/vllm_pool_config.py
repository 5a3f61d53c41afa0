"""The pool configuration a vLLM engine expects, built from its ``KVCacheConfig`` and
``VllmConfig`` (:func:`pool_config_from_vllm`), and how an existing pool differs from it
(:func:`pool_config_differences`, :class:`PoolMismatchError`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from .errors import FailedPreconditionError

__all__ = ["PoolMismatchError", "pool_config_differences", "pool_config_from_vllm"]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


#: vLLM's attention specs made of the page's fields and at most one length field: (the
#: group's field, its message, the spec's length field, "" for none)
_PAGED_GROUPS: dict[str, tuple[str, Any, str]] = {
    "SlidingWindowSpec": ("sliding_window", pb.SlidingWindowSpec, "sliding_window"),
    "ChunkedLocalAttentionSpec": ("chunked_local", pb.ChunkedLocalAttentionSpec, "attention_chunk_size"),
    "CrossAttentionSpec": ("cross_attention", pb.CrossAttentionSpec, ""),
}


def _group_spec(spec: Any) -> pb.KVCacheGroupSpec:
    """One vLLM KVCacheSpec as a kvcoord group (dispatch on vLLM's class names)."""
    kind = type(spec).__name__
    if kind == "UniformTypeKVCacheSpecs":  # layers of one attention type, different page sizes
        return _group_spec(next(iter(spec.kv_cache_specs.values())))
    bs = int(spec.block_size)
    heads = int(getattr(spec, "num_kv_heads", 0) or 0)
    head = int(getattr(spec, "head_size", 0) or 0)
    dtype = _dtype_name(getattr(spec, "dtype", None))
    if kind in ("FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec"):
        return pb.KVCacheGroupSpec(
            full=pb.FullAttentionSpec(
                block_size=bs,
                num_kv_heads=heads,
                head_size=head,
                dtype=dtype,
                use_mla=kind == "MLAAttentionSpec",
                sink_len=int(getattr(spec, "sink_len", 0) or 0),
            )  # fmt: skip
        )
    paged = _PAGED_GROUPS.get(kind)
    if paged is not None:  # attention over a window or a chunk (a length field), or cross-attention
        group, message, length = paged
        made = message(block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype)
        if length:
            setattr(made, length, int(getattr(spec, length)))
        return pb.KVCacheGroupSpec(**{group: made})
    if kind == "MambaSpec":
        return pb.KVCacheGroupSpec(
            mamba=pb.MambaSpec(
                block_size=bs,
                mamba_cache_mode=str(spec.mamba_cache_mode),
                num_speculative_blocks=int(spec.num_speculative_blocks),
                shape_dims=[int(d) for shape in spec.shapes for d in shape],
                dtypes=[_dtype_name(d) for d in spec.dtypes],
                num_prefill_checkpoint_blocks=int(getattr(spec, "num_prefill_checkpoint_blocks", 0)),
                prefill_checkpoint_alignment=_optional_int(
                    getattr(spec, "prefill_checkpoint_alignment", None)
                ),
            )
        )
    raise ValueError(f"kvcoord has no KV cache group type for vLLM's {kind}")


def pool_config_from_vllm(
    kv_cache_config: Any, vllm_config: Any, *, log_stats: bool = True, hash_seed: str | None = None
) -> pb.PoolConfig:
    """The pool an engine with these configs expects, as vLLM's engine core builds its manager.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (after profiling: ``num_blocks`` set).
        vllm_config: vLLM's ``VllmConfig``.
        log_stats: the engine's ``log_stats`` (``--disable-log-stats`` turns it off).
        hash_seed: the seed block hashes derive from; defaults to ``$PYTHONHASHSEED``.

    Returns:
        A ``PoolConfig`` for ``create_pool`` or for comparison with an existing pool.
    """
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    events = vllm_config.kv_events_config
    spec = vllm_config.speculative_config
    caching = bool(cache.enable_prefix_caching)
    seed = hash_seed if hash_seed is not None else os.environ.get("PYTHONHASHSEED", "")
    block_size = (
        int(cache.block_size)
        * int(getattr(parallel, "decode_context_parallel_size", 1))
        * int(getattr(parallel, "prefill_context_parallel_size", 1))
    )
    return pb.PoolConfig(
        num_blocks=int(kv_cache_config.num_blocks),
        groups=[_group_spec(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups],
        hash_block_size=block_size,
        enable_caching=caching,
        use_eagle=bool(spec is not None and spec.use_eagle()),
        enable_kv_cache_events=bool(events is not None and events.enable_kv_cache_events),
        log_stats=log_stats,
        max_model_len=int(vllm_config.model_config.max_model_len),
        hash_algo=str(cache.prefix_caching_hash_algo) if caching else "",
        hash_seed=seed if caching else "",
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


_GROUP_FIELDS = {
    "full": ("block_size", "sink_len"),
    "sliding_window": ("block_size", "sliding_window"),
    "chunked_local": ("block_size", "attention_chunk_size"),
    "mamba": (
        "block_size",
        "mamba_cache_mode",
        "num_speculative_blocks",
        "num_prefill_checkpoint_blocks",
        "prefill_checkpoint_alignment",
    ),  # fmt: skip
    "cross_attention": ("block_size",),
}


def _describe_group(g: pb.KVCacheGroupSpec) -> str:
    kind = g.WhichOneof("spec") or "none"
    spec = getattr(g, kind) if kind != "none" else None
    fields = ", ".join(f"{f}={getattr(spec, f)}" for f in _GROUP_FIELDS.get(kind, ()))
    return f"{kind}({fields})"


def pool_config_differences(expected: pb.PoolConfig, actual: pb.PoolConfig) -> list[str]:
    """Every setting in which a pool differs from what the engine expects, one line each.

    Compared: the groups (type, block size and the fields that change allocation; page-size
    fields only decide grouping, which the engine already did), block count, hash block
    size, caching, EAGLE (and its groups), events, stats, max_model_len, mamba shared-prefix checkpoints,
    hash algorithm and seed.
    """
    diffs: list[str] = []

    def differ(name: str, want: object, got: object) -> None:
        if want != got:
            diffs.append(f"{name}: engine expects {want!r}, pool has {got!r}")

    differ("num_blocks", expected.num_blocks, actual.num_blocks)
    differ("number of KV cache groups", len(expected.groups), len(actual.groups))
    for i, (e, a) in enumerate(zip(expected.groups, actual.groups, strict=False)):
        differ(f"group {i}", _describe_group(e), _describe_group(a))
    differ("hash_block_size", expected.hash_block_size, actual.hash_block_size)
    differ("enable_caching", expected.enable_caching, actual.enable_caching)
    differ("use_eagle", expected.use_eagle, actual.use_eagle)
    differ("eagle_group_ids", list(expected.eagle_group_ids), list(actual.eagle_group_ids))
    differ("enable_kv_cache_events", expected.enable_kv_cache_events, actual.enable_kv_cache_events)
    differ(
        "log_stats",
        not expected.HasField("log_stats") or expected.log_stats,
        not actual.HasField("log_stats") or actual.log_stats,
    )
    differ("max_model_len", expected.max_model_len, actual.max_model_len)
    differ(
        "mamba_shared_prefix_checkpoint",
        expected.mamba_shared_prefix_checkpoint,
        actual.mamba_shared_prefix_checkpoint,
    )
    if expected.enable_caching:
        differ("hash_algo", expected.hash_algo, actual.hash_algo)
        differ("hash_seed", expected.hash_seed, actual.hash_seed)
    return diffs


class PoolMismatchError(FailedPreconditionError):
    """The pool's layout or settings differ from the engine's; ``differences`` names each."""

    def __init__(self, pool: str, differences: Sequence[str]) -> None:
        self.differences = list(differences)
        super().__init__(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pool {pool!r} does not match this vLLM engine: " + "; ".join(self.differences),
        )
