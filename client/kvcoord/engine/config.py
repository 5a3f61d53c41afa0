"""The KV cache configuration of one pool, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .errors import ConfigError
from .profiles import PROFILES, VLLM_016, VLLM_033
from .specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = ["KVCacheConfig", "admission_cap_tokens", "attention_groups"]

_SPEC_TYPES = (
    FullAttentionSpec,
    SlidingWindowSpec,
    ChunkedLocalAttentionSpec,
    MambaSpec,
    CrossAttentionSpec,
)


def admission_cap_tokens(cfg: KVCacheConfig) -> list[int | None]:
    """vLLM 0.33's per-request admission cap of each group, in tokens (``None``: none):
    sliding window ``w - 1 + in-flight``, chunked local ``chunk + in-flight``, at most
    ``max_model_len``, rounded up to whole blocks."""
    in_flight = cfg.max_in_flight_tokens or cfg.max_model_len
    caps: list[int | None] = []
    for spec in cfg.groups:
        if isinstance(spec, SlidingWindowSpec):
            tokens = spec.sliding_window - 1 + in_flight
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            tokens = spec.attention_chunk_size + in_flight
        else:
            caps.append(None)
            continue
        bs = spec.block_size
        caps.append(-(-min(tokens, cfg.max_model_len) // bs) * bs)
    return caps


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Everything that decides allocation in one pool.

    Args:
        num_blocks: physical blocks including the null block 0; at least 1.
        groups: KV cache group specs in group-id order.
        hash_block_size: token granularity of the request block hashes.
        enable_caching: prefix caching on/off.
        use_eagle: EAGLE/MTP drafting: every prefix hit drops its last block (vllm-0.33:
            the hit of each group in ``eagle_group_ids``, per vLLM 0.33's coordinator).
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared.
        log_stats: keep prefix-cache statistics.
        max_model_len: caps token counts in ``allocate_slots``.
        hash_length: when set, every block hash must have exactly this many bytes.
        dcp_world_size: decode context parallelism; only 1 is supported.
        pcp_world_size: prefill context parallelism; only 1 is supported.
        profile: the vLLM release whose semantics the pool follows (see
            :mod:`~kvcoord.engine.profiles`): ``"vllm-0.16"`` (default) or
            ``"vllm-0.33"``.
        num_hash_lookahead_tokens: (vllm-0.33, caching on) L: each block hash also
            covers the next L tokens, so a request has hashes only for the blocks
            followed by L tokens, and only those are cached (vLLM 0.33's EAGLE/MTP
            default, with ``use_eagle`` off).
        max_in_flight_tokens: (vllm-0.33) the scheduler's tokens in flight (its token
            budget, with one batch in flight); sizes vLLM 0.33's per-request admission
            cap of sliding-window and chunked-local groups (``full_sequence_must_fit``).
            0: no bound (the cap is then ``max_model_len``).
        scheduler_block_size: (vllm-0.33) the scheduler's block granularity; hybrid
            hits and caching are aligned to it. 0: the LCM of the block sizes (the
            only value vLLM uses without context parallelism, and the only one taken).
        prefix_cache_retention_interval: (vllm-0.33) ``0`` (vLLM 0.33's default):
            sliding-window and mamba groups hash only the blocks a later lookup can
            reach (the prompt's replay boundary, a detected shared-prefix junction); ``None``:
            a window tail at every scheduler block (dense). A positive multiple of the
            scheduler block size (a model with a sliding-window group, no mamba group):
            a window tail once per interval, and those of the reachable boundaries.
        needs_kv_cache_zeroing: (vllm-0.33) the worker zeroes newly allocated KV cache
            blocks (vLLM 0.33's ``KVCacheConfig.needs_kv_cache_zeroing``, set for a
            mixed-precision KV cache): the pool records the ids of the blocks its
            attention groups take for ``take_new_block_ids``. A pool with a mamba group
            records them whatever this says (vLLM zeroes for mamba layers always).
        mamba_shared_prefix_checkpoint: (vllm-0.33, fine-grained hits only) vLLM 0.33's
            ``KVCacheManager.mamba_shared_prefix_checkpoint``: the option
            ``enable_mamba_shared_prefix_checkpoint`` as vLLM narrows it (an EAGLE group,
            fine-grained hits, no MTP re-prefill tail). Each mamba group then also keys
            its state at the request's shared-prefix junction when a step computing a
            prompt chunk stops exactly there (besides the prompt's last hash boundary).
        eagle_group_ids: (vllm-0.33, with ``use_eagle``) the groups vLLM 0.33 flags
            ``is_eagle_group`` (those holding draft layers): only their hits drop a block
            (with their attention group's: groups of one spec are searched together).
            Empty: every group drops, as vLLM does when no group is flagged.

    Raises:
        ConfigError: the layout breaks a rule vLLM enforces (at construction or at its
            first lookup); the message names the rule.
    """

    num_blocks: int
    groups: tuple[AttentionSpec, ...]
    hash_block_size: int
    enable_caching: bool = True
    use_eagle: bool = False
    enable_kv_cache_events: bool = False
    log_stats: bool = True
    max_model_len: int = 1 << 31
    hash_length: int | None = None
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    profile: str = VLLM_016
    num_hash_lookahead_tokens: int = 0
    max_in_flight_tokens: int = 0
    scheduler_block_size: int = 0
    prefix_cache_retention_interval: int | None = 0
    needs_kv_cache_zeroing: bool = False
    mamba_shared_prefix_checkpoint: bool = False
    eagle_group_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "eagle_group_ids", tuple(self.eagle_group_ids))
        _validate(self)

    @property
    def partial_hash_hits(self) -> bool:
        """vLLM 0.33's fine-grained (partial) prefix hits (``enable_partial_hash_hits``):
        a vllm-0.33 hybrid pool with caching whose mamba "align" group has a block
        larger than the hash block, every other group being full attention or mamba
        (whose managers search hash by hash). Hits then end on any hash-block
        boundary, copy-on-write included (:mod:`kvcoord.engine.managers.partial`)."""
        return (
            self.profile == VLLM_033
            and self.enable_caching
            and len(self.groups) > 1
            and any(
                isinstance(g, MambaSpec)
                and g.mamba_cache_mode == MambaCacheMode.ALIGN
                and g.block_size > self.hash_block_size
                for g in self.groups
            )
            and all(
                isinstance(g, (FullAttentionSpec, MambaSpec)) or g.block_size == self.hash_block_size
                for g in self.groups
            )
        )

    @property
    def eagle_drop_groups(self) -> frozenset[int]:
        """The groups whose prefix hits drop EAGLE's last block: none without
        ``use_eagle``; else the flagged ``eagle_group_ids`` (vllm-0.33), all when none is
        flagged."""
        if not self.use_eagle:
            return frozenset()
        return frozenset(self.eagle_group_ids or range(len(self.groups)))

    def eagle_drops(self, ids: Sequence[int]) -> bool:
        """Whether the attention group of these group ids drops EAGLE's block (any of
        them flagged: vLLM decides it for the whole spec group)."""
        drops = self.eagle_drop_groups
        return any(gid in drops for gid in ids)

    @property
    def coordinator_kind(self) -> str:
        """``"no_prefix_cache"``, ``"unitary"`` or ``"hybrid"``, by vLLM's factory rule."""
        if not self.enable_caching:
            return "no_prefix_cache"
        if len(self.groups) == 1:
            return "unitary"
        return "hybrid"


def attention_groups(groups: tuple[AttentionSpec, ...]) -> list[tuple[AttentionSpec, list[int]]]:
    """Split groups into attention groups: equal specs share one, full attention first.

    Args:
        groups: the KV cache group specs in group order.

    Returns:
        ``(spec, group ids)`` pairs, first-seen order, stably sorted so that
        full-attention specs come first.
    """
    result: list[tuple[AttentionSpec, list[int]]] = []
    for gid, spec in enumerate(groups):
        for existing, ids in result:
            if existing == spec:
                ids.append(gid)
                break
        else:
            result.append((spec, [gid]))
    result.sort(key=lambda item: not isinstance(item[0], FullAttentionSpec))
    return result


def _positive_int(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")


def _validate(cfg: KVCacheConfig) -> None:
    _positive_int(cfg.num_blocks, "num_blocks")
    _positive_int(cfg.hash_block_size, "hash_block_size")
    _positive_int(cfg.max_model_len, "max_model_len")
    if cfg.hash_length is not None:
        _positive_int(cfg.hash_length, "hash_length")
    if cfg.dcp_world_size != 1 or cfg.pcp_world_size != 1:
        raise ConfigError(
            "decode/prefill context parallelism is not supported: dcp_world_size and "
            f"pcp_world_size must be 1, got {cfg.dcp_world_size} and {cfg.pcp_world_size}"
        )
    if cfg.profile not in PROFILES:
        raise ConfigError(f"profile must be one of {', '.join(PROFILES)}, got {cfg.profile!r}")
    n = cfg.num_hash_lookahead_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"num_hash_lookahead_tokens must be >= 0, got {n!r}")
    if n and (cfg.profile != VLLM_033 or not cfg.enable_caching):
        raise ConfigError("num_hash_lookahead_tokens needs the vllm-0.33 profile and prefix caching")
    m = cfg.max_in_flight_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ConfigError(f"max_in_flight_tokens must be >= 0, got {m!r}")
    if not isinstance(cfg.needs_kv_cache_zeroing, bool):
        raise ConfigError(f"needs_kv_cache_zeroing must be a bool, got {cfg.needs_kv_cache_zeroing!r}")
    ids = cfg.eagle_group_ids
    if any(isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(cfg.groups) for g in ids) or len(
        set(ids)
    ) != len(ids):
        raise ConfigError(f"eagle_group_ids must be distinct group ids below {len(cfg.groups)}, got {ids!r}")
    if ids and cfg.profile != VLLM_033:
        raise ConfigError("eagle_group_ids is a vLLM 0.33 field; this pool's profile is " + cfg.profile)
    if cfg.needs_kv_cache_zeroing and cfg.profile != VLLM_033:
        raise ConfigError(
            "needs_kv_cache_zeroing is a vLLM 0.33 field; this pool's profile is " + cfg.profile
        )
    _validate_shared_prefix_checkpoint(cfg)
    sink_blocks = 0
    for gid, spec in enumerate(cfg.groups):
        if not isinstance(spec, _SPEC_TYPES):
            raise ConfigError(f"group {gid}: unknown attention spec {spec!r}")
        _positive_int(spec.block_size, f"group {gid}: block_size")
        if isinstance(spec, SlidingWindowSpec):
            _positive_int(spec.sliding_window, f"group {gid}: sliding_window")
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            _positive_int(spec.attention_chunk_size, f"group {gid}: attention_chunk_size")
        elif isinstance(spec, MambaSpec):
            n = spec.num_speculative_blocks
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"group {gid}: num_speculative_blocks must be >= 0, got {n!r}")
            _validate_checkpoint_fields(cfg, gid, spec)
        elif isinstance(spec, FullAttentionSpec) and spec.sink_len is not None:
            _positive_int(spec.sink_len, f"group {gid}: sink_len")
            if spec.sink_len % spec.block_size:
                raise ConfigError(
                    f"group {gid}: sink_len {spec.sink_len} must be a multiple of "
                    f"block_size {spec.block_size}"
                )
            sink_blocks += spec.sink_len // spec.block_size
    if sink_blocks > cfg.num_blocks - 1:
        raise ConfigError(
            f"sink attention needs {sink_blocks} blocks but the pool has only "
            f"{cfg.num_blocks - 1} usable blocks"
        )
    if cfg.profile == VLLM_033:
        _validate_033_support(cfg)
    if not cfg.enable_caching:
        return
    _validate_caching(cfg)


def _validate_checkpoint_fields(cfg: KVCacheConfig, gid: int, spec: MambaSpec) -> None:
    """A mamba group's prefill checkpoint fields (vLLM 0.33's): counts in range, and only
    where that release has them."""
    n = spec.num_prefill_checkpoint_blocks
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"group {gid}: num_prefill_checkpoint_blocks must be >= 0, got {n!r}")
    a = spec.prefill_checkpoint_alignment
    if a is not None:
        _positive_int(a, f"group {gid}: prefill_checkpoint_alignment")
    if (n or a is not None) and cfg.profile != VLLM_033:
        raise ConfigError(
            f"group {gid}: prefill checkpoint blocks are a vLLM 0.33 field; this pool's profile is {cfg.profile}"
        )


def _validate_033_support(cfg: KVCacheConfig) -> None:
    """Refuse the vllm-0.33 layouts kvcoord does not reproduce yet, rather than answer
    them with any other release's rules (docs/semantics-notes.md lists them)."""
    missing = []
    lcm = math.lcm(*(g.block_size for g in cfg.groups)) if cfg.groups else 0
    if cfg.scheduler_block_size not in (0, lcm):
        missing.append(f"scheduler_block_size {cfg.scheduler_block_size} other than the LCM {lcm}")
    for gid, spec in enumerate(cfg.groups):
        if isinstance(spec, FullAttentionSpec) and spec.sink_len:
            # vLLM 0.33.0's SinkFullAttentionManager does not take the needs_kv_cache_zeroing
            # argument its coordinator passes every manager: its engine fails at start
            missing.append(f"group {gid}: sink attention (vLLM 0.33.0 itself cannot build its sink manager)")
    interval = cfg.prefix_cache_retention_interval
    if interval not in (None, 0):
        _validate_retention_interval(cfg, interval, cfg.scheduler_block_size or lcm)
        if any(isinstance(spec, MambaSpec) for spec in cfg.groups):
            missing.append("a positive prefix_cache_retention_interval beside a mamba group")
    if cfg.use_eagle:
        missing.extend(_eagle_033_gaps(cfg))
    for gid, spec in enumerate(cfg.groups):
        if isinstance(spec, MambaSpec):
            missing.extend(_mamba_033_gaps(cfg, gid, spec))
    if missing:
        raise ConfigError("the vllm-0.33 profile does not support yet: " + "; ".join(missing))


def _validate_shared_prefix_checkpoint(cfg: KVCacheConfig) -> None:
    """``mamba_shared_prefix_checkpoint``: a bool, and True only where vLLM 0.33's
    manager can turn it on (fine-grained hits, which need the vllm-0.33 profile)."""
    flag = cfg.mamba_shared_prefix_checkpoint
    if not isinstance(flag, bool):
        raise ConfigError(f"mamba_shared_prefix_checkpoint must be a bool, got {flag!r}")
    if flag and not cfg.partial_hash_hits:
        raise ConfigError(
            "mamba_shared_prefix_checkpoint needs the vllm-0.33 profile with fine-grained hits "
            "(prefix caching, a mamba align group whose block is larger than the hash block): "
            "vLLM 0.33's manager turns it off otherwise"
        )
    if flag and (
        cfg.num_hash_lookahead_tokens
        or any(
            isinstance(g, MambaSpec) and (g.num_prefill_checkpoint_blocks or g.num_speculative_blocks)
            for g in cfg.groups
        )
    ):
        # (each runs beside fine-grained hits; with the junction's key too, untested against vLLM)
        raise ConfigError(
            "mamba_shared_prefix_checkpoint beside prefill checkpoint blocks, speculative mamba "
            "blocks or look-ahead block hashes: not modelled together by the vllm-0.33 profile"
        )


def _eagle_033_gaps(cfg: KVCacheConfig) -> list[str]:
    """What vLLM 0.33's EAGLE/MTP trailing-block drop (``use_eagle``) needs that the
    vllm-0.33 profile does not model: the drop beside a mamba group (0.33 moves the mamba
    checkpoints back a block, ``drop_eagle_checkpoint_block``) and with look-ahead hashes
    (vLLM never combines them)."""
    gaps = []
    if cfg.num_hash_lookahead_tokens:
        gaps.append(
            "EAGLE's trailing-block drop together with look-ahead block hashes (vLLM uses one or the other)"
        )
    for gid, spec in enumerate(cfg.groups):
        if isinstance(spec, MambaSpec) and (cfg.enable_caching or spec.num_prefill_checkpoint_blocks):
            gaps.append(
                f"group {gid}: EAGLE's trailing-block drop beside a mamba group (0.33 moves its "
                "checkpoints back a block)"
            )
    return gaps


def _validate_retention_interval(cfg: KVCacheConfig, interval: object, scheduler_block_size: int) -> None:
    """vLLM 0.33's rules for a positive ``prefix_cache_retention_interval``: it applies to
    sliding-window and mamba groups only, at multiples of the scheduler block size."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ConfigError(f"prefix_cache_retention_interval must be None or >= 0, got {interval!r}")
    if not any(isinstance(spec, (SlidingWindowSpec, MambaSpec)) for spec in cfg.groups):
        raise ConfigError(
            "prefix_cache_retention_interval is positive but no group is sliding window or mamba "
            "(it applies to those only; vLLM requires 0)"
        )
    if interval % scheduler_block_size:
        raise ConfigError(
            f"prefix_cache_retention_interval {interval} must be a multiple of the scheduler "
            f"block size {scheduler_block_size}"
        )


def _mamba_033_gaps(cfg: KVCacheConfig, gid: int, spec: MambaSpec) -> list[str]:
    """What a mamba group needs that the vllm-0.33 profile does not model (see
    :class:`~kvcoord.engine.managers.mamba033.MambaManager033`)."""
    gaps = []
    if cfg.enable_caching and spec.mamba_cache_mode != MambaCacheMode.ALIGN:
        # vLLM 0.33 asserts it: its mamba prefix caching exists only in "align" mode
        gaps.append(
            f"group {gid}: mamba prefix caching in mode {spec.mamba_cache_mode.value!r} (0.33 requires 'align')"
        )
    if cfg.enable_caching and spec.block_size != cfg.hash_block_size:
        why = _partial_hit_gaps(cfg, spec)
        if why:
            gaps.append(
                f"group {gid}: mamba block_size {spec.block_size} other than hash_block_size "
                f"{cfg.hash_block_size} (0.33's sub-block hits with copy-on-write) " + ", ".join(why)
            )
    if cfg.enable_caching and len(cfg.groups) == 1:
        gaps.append(f"group {gid}: a mamba-only pool with prefix caching (0.33's unitary mamba)")
    return gaps


def _partial_hit_gaps(cfg: KVCacheConfig, spec: MambaSpec) -> list[str]:
    """What a mamba group with sub-block hits needs that kvcoord does not model yet."""
    if not cfg.partial_hash_hits:
        return ["beside a group that needs block-aligned hits"]
    gaps = []
    if any(not isinstance(g, (FullAttentionSpec, MambaSpec)) for g in cfg.groups):
        gaps.append("beside sliding-window or chunked-local groups")
    if len({g.block_size for g in cfg.groups}) > 1:
        gaps.append("beside groups of another block size")
    # (prefill checkpoint blocks, speculative mamba blocks and look-ahead hashes are
    # modelled beside sub-block hits: PartialMambaManager)
    return gaps


def _validate_caching(cfg: KVCacheConfig) -> None:
    if not cfg.groups:
        raise ConfigError("prefix caching needs at least one KV cache group")
    for gid, spec in enumerate(cfg.groups):
        if isinstance(spec, CrossAttentionSpec):
            raise ConfigError(
                f"group {gid}: cross-attention blocks cannot be prefix-cached; "
                "create the pool with enable_caching=false"
            )
        if isinstance(spec, ChunkedLocalAttentionSpec) and cfg.eagle_drops([gid]):
            raise ConfigError(f"group {gid}: chunked local attention does not support EAGLE")
    if len(cfg.groups) == 1:
        bs = cfg.groups[0].block_size
        if bs != cfg.hash_block_size:
            raise ConfigError(
                f"a single-group pool needs hash_block_size == block_size, got "
                f"hash_block_size {cfg.hash_block_size} and block_size {bs}"
            )
        return
    for gid, spec in enumerate(cfg.groups):
        if spec.block_size % cfg.hash_block_size:
            raise ConfigError(
                f"group {gid}: block_size {spec.block_size} is not a multiple of "
                f"hash_block_size {cfg.hash_block_size}"
            )
    groups = attention_groups(cfg.groups)
    if len(groups) < 2:
        raise ConfigError(
            "a multi-group pool with prefix caching needs at least two distinct "
            "attention specs; these groups all share one spec (use one group)"
        )
    lcm = math.lcm(*(spec.block_size for spec, _ in groups))
    for spec, ids in groups:
        if isinstance(spec, ChunkedLocalAttentionSpec) and cfg.eagle_drops(ids):
            raise ConfigError(f"group {ids[0]}: chunked local attention does not support EAGLE")
        if isinstance(spec, ChunkedLocalAttentionSpec) and spec.block_size != lcm:
            raise ConfigError(
                f"group {ids[0]}: chunked local attention needs block_size equal to the "
                f"LCM of all block sizes ({lcm}), got {spec.block_size}"
            )
        if isinstance(spec, SlidingWindowSpec) and cfg.eagle_drops(ids) and spec.block_size != lcm:
            raise ConfigError(
                f"group {ids[0]}: with EAGLE a sliding-window group needs block_size equal "
                f"to the LCM of all block sizes ({lcm}), got {spec.block_size}"
            )
