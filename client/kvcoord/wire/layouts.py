"""Pool layouts: a PoolConfig message <-> the engine's KVCacheConfig, and the table
form a pool takes in the server's config file and in a conformance trace's config line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvcoord.engine import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from kvcoord.engine.profiles import VLLM_016
from kvcoord.v1 import allocator_pb2 as pb

from .errors import WireError
from .hashes import HASH_LENGTHS

__all__ = [
    "MAX_MODEL_LEN_UNLIMITED",
    "ConfigFileError",
    "config_from_pb",
    "group_kinds",
    "pool_config_from_table",
    "spec_from_pb",
    "string_list",
    "tables",
]

#: The engine's max_model_len for a PoolConfig that sets none (0 on the wire).
MAX_MODEL_LEN_UNLIMITED = 1 << 31


def spec_from_pb(group: pb.KVCacheGroupSpec, gid: int) -> AttentionSpec:
    """One group spec.

    Raises:
        WireError: the oneof is unset, or a mamba cache mode is unknown.
    """
    kind = group.WhichOneof("spec")
    if kind == "full":
        f = group.full
        return FullAttentionSpec(
            f.block_size,
            f.num_kv_heads or 1,
            f.head_size or 1,
            f.dtype or "auto",
            f.use_mla,
            f.sink_len or None,
        )
    if kind == "sliding_window":
        s = group.sliding_window
        return SlidingWindowSpec(
            s.block_size, s.sliding_window, s.num_kv_heads or 1, s.head_size or 1, s.dtype or "auto"
        )
    if kind == "chunked_local":
        c = group.chunked_local
        return ChunkedLocalAttentionSpec(
            c.block_size, c.attention_chunk_size, c.num_kv_heads or 1, c.head_size or 1, c.dtype or "auto"
        )
    if kind == "mamba":
        m = group.mamba
        try:
            mode = MambaCacheMode(m.mamba_cache_mode or "none")
        except ValueError:
            raise WireError(
                f"groups[{gid}].mamba.mamba_cache_mode must be none, all or align, got {m.mamba_cache_mode!r}"
            ) from None
        shapes = (tuple(m.shape_dims),) if m.shape_dims else ()
        alignment = m.prefill_checkpoint_alignment if m.HasField("prefill_checkpoint_alignment") else None
        return MambaSpec(
            m.block_size, mode, m.num_speculative_blocks, shapes, tuple(m.dtypes),
            m.num_prefill_checkpoint_blocks, alignment,
        )  # fmt: skip
    if kind == "cross_attention":
        x = group.cross_attention
        return CrossAttentionSpec(x.block_size, x.num_kv_heads or 1, x.head_size or 1, x.dtype or "auto")
    raise WireError(
        f"groups[{gid}] has no spec: set one of full, sliding_window, chunked_local, mamba, cross_attention"
    )


def group_kinds(groups: Iterable[pb.KVCacheGroupSpec]) -> list[str]:
    """Each group's spec name (``full``, ``sliding_window`` ...), in order; a group
    whose spec is unset reads as ``full``."""
    return [g.WhichOneof("spec") or "full" for g in groups]


def config_from_pb(cfg: pb.PoolConfig) -> KVCacheConfig:
    """The engine config of a wire config; hash settings are checked here.

    Raises:
        WireError: missing or unknown hash settings, a group without a spec.
        ConfigError: an invalid layout (the engine names the rule).
    """
    if cfg.enable_caching:
        if cfg.hash_algo not in HASH_LENGTHS:
            raise WireError(
                f"hash_algo must be one of {sorted(HASH_LENGTHS)} when caching is on, got {cfg.hash_algo!r}"
            )
        if not cfg.hash_seed:
            raise WireError(
                "hash_seed is required when caching is on: workers must hash with a fixed "
                "PYTHONHASHSEED, or their hashes never match across processes"
            )
    elif cfg.hash_algo and cfg.hash_algo not in HASH_LENGTHS:
        raise WireError(f"unknown hash_algo {cfg.hash_algo!r}")
    return KVCacheConfig(
        num_blocks=cfg.num_blocks,
        groups=tuple(spec_from_pb(g, i) for i, g in enumerate(cfg.groups)),
        hash_block_size=cfg.hash_block_size,
        enable_caching=cfg.enable_caching,
        use_eagle=cfg.use_eagle,
        enable_kv_cache_events=cfg.enable_kv_cache_events,
        log_stats=cfg.log_stats if cfg.HasField("log_stats") else True,
        max_model_len=cfg.max_model_len or MAX_MODEL_LEN_UNLIMITED,
        hash_length=HASH_LENGTHS.get(cfg.hash_algo) if cfg.enable_caching else None,
        profile=cfg.profile or VLLM_016,
        num_hash_lookahead_tokens=cfg.num_hash_lookahead_tokens,
        max_in_flight_tokens=cfg.max_in_flight_tokens,
        scheduler_block_size=cfg.scheduler_block_size,
        prefix_cache_retention_interval=_retention_from_pb(cfg),
        needs_kv_cache_zeroing=cfg.needs_kv_cache_zeroing,
        mamba_shared_prefix_checkpoint=cfg.mamba_shared_prefix_checkpoint,
        eagle_group_ids=tuple(cfg.eagle_group_ids),
    )


def _retention_from_pb(cfg: pb.PoolConfig) -> int | None:
    """``prefix_cache_retention_interval``: unset = 0 (sparse), -1 = None (dense).

    Raises:
        WireError: a value below -1.
    """
    if not cfg.HasField("prefix_cache_retention_interval"):
        return 0
    value = cfg.prefix_cache_retention_interval
    if value < -1:
        raise WireError(f"prefix_cache_retention_interval must be -1 (dense) or >= 0, got {value}")
    return None if value == -1 else value


# -- the table form (TOML [[pools]], a trace's config line) -----------------------------


class ConfigFileError(ValueError):
    """A configuration (the server's file, a trace's config line) is not valid; the
    message names the key."""


_GROUP_TYPES = {
    "full": ("full", pb.FullAttentionSpec),
    "sliding_window": ("sliding_window", pb.SlidingWindowSpec),
    "chunked_local": ("chunked_local", pb.ChunkedLocalAttentionSpec),
    "mamba": ("mamba", pb.MambaSpec),
    "cross_attention": ("cross_attention", pb.CrossAttentionSpec),
}

_POOL_KEYS = {
    "num_blocks", "hash_block_size", "hash_algo", "hash_seed", "enable_caching", "use_eagle",
    "enable_kv_cache_events", "log_stats", "max_model_len", "shared_cache_tenants", "profile",
    "num_hash_lookahead_tokens", "max_in_flight_tokens", "scheduler_block_size",
    "prefix_cache_retention_interval", "needs_kv_cache_zeroing", "mamba_shared_prefix_checkpoint",
    "eagle_group_ids",
}  # fmt: skip


def string_list(value: Any, where: str) -> tuple[str, ...]:
    """A list-valued key's strings.

    A lone string is refused rather than iterated: ``auth_tokens = "secret"`` would
    otherwise make every character a token.

    Raises:
        ConfigFileError: names ``where``: not a list, or an item that is not a string.
    """
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        got = "a string" if isinstance(value, str) else type(value).__name__
        raise ConfigFileError(f'{where}: must be a list of strings, got {got} (write ["..."])')
    return tuple(value)


def tables(value: Any, where: str) -> list[Any]:
    """A list-valued key of tables (``[[pools]]``, ``[[pools.groups]]``).

    Raises:
        ConfigFileError: not a list.
    """
    if not isinstance(value, list):
        raise ConfigFileError(f"{where}: must be a list of tables ([[{where}]]), got {type(value).__name__}")
    return value


def pool_config_from_table(d: Mapping[str, Any], where: str) -> pb.PoolConfig:
    """A pool table (as in the config file; ``name`` is skipped) as a wire PoolConfig.

    Raises:
        ConfigFileError: an unknown key or group type, or a value of the wrong type.
    """
    cfg = pb.PoolConfig()
    for key, value in d.items():
        if key in ("name", "groups"):
            continue
        if key not in _POOL_KEYS:
            raise ConfigFileError(
                f"{where}: unknown key {key!r} (known: {sorted(_POOL_KEYS | {'name', 'groups'})})"
            )
        if key == "shared_cache_tenants":
            cfg.shared_cache_tenants.extend(string_list(value, f"{where}.{key}"))
            continue
        if key == "eagle_group_ids":
            if not isinstance(value, list):
                raise ConfigFileError(
                    f"{where}.{key}: must be a list of group ids, got {type(value).__name__}"
                )
            try:
                cfg.eagle_group_ids.extend(value)
            except (TypeError, ValueError) as exc:
                raise ConfigFileError(f"{where}.{key}: {exc}") from None
            continue
        try:
            setattr(cfg, key, value)
        except (TypeError, ValueError) as exc:
            raise ConfigFileError(f"{where}.{key}: {exc}") from None
    for i, g in enumerate(tables(d.get("groups", []), f"{where}.groups")):
        gwhere = f"{where}.groups[{i}]"
        if not isinstance(g, Mapping) or "type" not in g:
            raise ConfigFileError(f"{gwhere}: a group needs a 'type' ({', '.join(_GROUP_TYPES)})")
        kind = g["type"]
        if kind not in _GROUP_TYPES:
            raise ConfigFileError(f"{gwhere}.type: unknown group type {kind!r} ({', '.join(_GROUP_TYPES)})")
        field, cls = _GROUP_TYPES[kind]
        fields = {k: v for k, v in g.items() if k != "type"}
        try:
            spec = cls(**fields)
        except (TypeError, ValueError) as exc:
            raise ConfigFileError(f"{gwhere}: {exc}") from None
        cfg.groups.add().MergeFrom(pb.KVCacheGroupSpec(**{field: spec}))
    return cfg
