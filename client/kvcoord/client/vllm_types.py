"""vLLM's types as kvcoord gives them, importable without vLLM: the blocks the
scheduler and KV connectors read (:class:`KVCacheBlocks`), the statistics and KV events
(vLLM's own types when importable, plain equivalents here otherwise), and the pool
configuration built from the engine's ``KVCacheConfig`` and ``VllmConfig``
(:func:`pool_config_from_vllm`) with its comparison (:func:`pool_config_differences`).
:mod:`kvcoord.client.vllm` wraps a session in vLLM's manager interface with them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, overload

import grpc
from kvcoord import engine
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import STATS_FIELDS, events_from_pb

from .errors import (
    FailedPreconditionError,
)
from .manager import KVCacheBlockIds

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheBlock",
    "KVCacheBlocks",
    "PoolMismatchError",
    "PrefixCacheStats",
    "convert_engine_events",
    "convert_events",
    "convert_stats",
    "event_converter",
    "pool_config_differences",
    "pool_config_from_vllm",
    "vllm_available",
]

_MEDIUM_GPU = "GPU"


def vllm_available() -> bool:
    """Whether vLLM's v1 core can be imported here."""
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except ImportError:
        return False
    return True


# -- blocks ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheBlock:
    """One block of a request's table, as the scheduler and KV connectors see it.

    ``block_hash`` is vLLM's ``BlockHashWithGroupId`` (the block's hash followed by the
    4-byte big-endian group id) for a block holding a prefix-cache hash, else ``None``.
    """

    block_id: int
    block_hash: bytes | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0


class KVCacheBlocks:
    """Blocks per KV cache group: ``blocks[g][j]`` is group ``g``'s ``j``-th block.

    May be lazy (``make``): the blocks are built when first read. ``ids``, when given,
    are their ids per group, which answer ``get_block_ids`` and ``to_block_ids``
    without building them (what vLLM's scheduler reads of most answers).
    """

    __slots__ = ("_blocks", "_ids", "_make")

    def __init__(
        self,
        blocks: tuple[Sequence[KVCacheBlock], ...] | None = None,
        make: Callable[[], tuple[Sequence[KVCacheBlock], ...]] | None = None,
        ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self._blocks = blocks
        self._make = make
        self._ids = ids

    @property
    def blocks(self) -> tuple[Sequence[KVCacheBlock], ...]:
        if self._blocks is None:
            assert self._make is not None
            self._blocks, self._make = self._make(), None
        return self._blocks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlocks) and self.blocks == other.blocks

    def __hash__(self) -> int:
        return hash(tuple(tuple(g) for g in self.blocks))

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.blocks!r})" if self._blocks is not None else "KVCacheBlocks(<pending>)"

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(itertools.chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=False))
        )

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(self, allow_none: Literal[True]) -> tuple[list[int], ...] | None: ...

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; with ``allow_none``, ``None`` when every group is empty."""
        ids = self._ids
        if ids is not None:
            return None if allow_none and not any(ids) else tuple([*group] for group in ids)
        if allow_none and not any(self.blocks):
            return None
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a hash (single-group layouts only, as in vLLM)."""
        assert len(self.blocks) == 1, "Only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))

    def to_block_ids(self) -> KVCacheBlockIds:
        return KVCacheBlockIds(self.get_block_ids())


# -- stats and events (plain forms; vLLM's types replace them when importable) ---------


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's ``PrefixCacheStats`` fields, for when vLLM is not importable."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes | int]
    medium: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@functools.cache
def _event_types() -> tuple[Any, Any, Any]:
    """vLLM's event types (or kvcoord's plain ones), looked up once."""
    try:
        from vllm.distributed import kv_events
    except ImportError:
        return BlockStored, BlockRemoved, AllBlocksCleared
    return kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared


@functools.cache
def _stats_type() -> Any:
    try:
        from vllm.v1.metrics.stats import PrefixCacheStats as VllmPrefixCacheStats
    except ImportError:
        return PrefixCacheStats
    return VllmPrefixCacheStats


def _int_hashes() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default on): events carry ints."""
    try:
        import vllm.envs as envs
    except ImportError:
        return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").lower() in ("1", "true")
    return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


def convert_stats(stats: pb.PrefixCacheStats | engine.PrefixCacheStats) -> Any:
    """A PrefixCacheStats (the message or the engine's value) as vLLM's type (or
    :class:`PrefixCacheStats`)."""
    out = _stats_type()()
    for name in STATS_FIELDS:
        setattr(out, name, getattr(stats, name))
    return out


def convert_events(events: Iterable[pb.KVEvent], *, fields_033: bool = False) -> list[Any]:
    """Protobuf KV events as vLLM's event types (or kvcoord's plain ones), in order;
    with ``fields_033``, also the fields vLLM 0.33 added (a vllm-0.33 pool's events)."""
    return convert_engine_events(events_from_pb(events), fields_033=fields_033)


def convert_engine_events(events: Iterable[engine.KVCacheEvent], *, fields_033: bool = False) -> list[Any]:
    """The engine's KV events as vLLM's event types (or kvcoord's plain ones), in order
    (``fields_033`` as for :func:`convert_events`): :func:`event_converter`'s, made now."""
    return event_converter(fields_033=fields_033)(events)


def event_converter(*, fields_033: bool = False) -> Callable[[Iterable[engine.KVCacheEvent]], list[Any]]:
    """What :func:`convert_engine_events` does, with vLLM's event types and its
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES read once, now (a predicted manager converts
    each call's events as the engine makes them, as vLLM's block pool builds its own).

    With integer hashes, a removal of one block (a cached block reused: most of a busy
    pool's events) and a store of one block (a decode filling a block) are converted
    inline; every other event by :func:`_convert_event`."""
    stored_t, removed_t, cleared_t = _event_types()
    as_int = _int_hashes()
    if fields_033 or not as_int:

        def each(events: Iterable[engine.KVCacheEvent]) -> list[Any]:
            return [_convert_event(e, stored_t, removed_t, cleared_t, as_int, fields_033) for e in events]

        return each
    mask = _MASK64
    from_bytes = int.from_bytes
    removed, stored = engine.BlockRemoved, engine.BlockStored
    gpu = _MEDIUM_GPU

    def convert(events: Iterable[engine.KVCacheEvent]) -> list[Any]:
        out: list[Any] = []
        append = out.append
        for e in events:
            if type(e) is removed:
                raw = e.block_hashes
                if len(raw) == 1:
                    append(removed_t(block_hashes=[from_bytes(raw[0], "big") & mask], medium=e.medium or gpu))
                    continue
            elif type(e) is stored:
                raw = e.block_hashes
                parent = e.parent_block_hash
                if len(raw) == 1 and parent is not None:
                    append(
                        stored_t(
                            block_hashes=[from_bytes(raw[0], "big") & mask],
                            parent_block_hash=from_bytes(parent, "big") & mask,
                            token_ids=list(e.token_ids),
                            block_size=e.block_size,
                            lora_id=e.lora_id,
                            medium=e.medium or gpu,
                            lora_name=e.lora_name,
                        )
                    )
                    continue
            append(_convert_event(e, stored_t, removed_t, cleared_t, True, False))
        return out

    return convert


_MASK64 = (1 << 64) - 1


def _hashes(raw: Sequence[bytes], as_int: bool) -> list[Any]:
    if as_int:
        return [int.from_bytes(x, "big") & _MASK64 for x in raw]
    return [x if type(x) is bytes else bytes(x) for x in raw]


def _convert_event(
    e: engine.KVCacheEvent, stored_t: Any, removed_t: Any, cleared_t: Any, as_int: bool, fields_033: bool
) -> Any:
    """One engine event as vLLM's type (see :func:`convert_engine_events`)."""
    if isinstance(e, engine.BlockStored):
        raw = e.parent_block_hash
        parent = None if raw is None else int.from_bytes(raw, "big") & _MASK64 if as_int else bytes(raw)
        more = _stored_fields_033(e) if fields_033 else {}
        return stored_t(
            block_hashes=_hashes(e.block_hashes, as_int),
            parent_block_hash=parent,
            token_ids=list(e.token_ids),
            block_size=e.block_size,
            lora_id=e.lora_id,
            medium=e.medium or _MEDIUM_GPU,
            lora_name=e.lora_name,
            **more,
        )
    if isinstance(e, engine.BlockRemoved):
        if fields_033:
            return removed_t(
                block_hashes=_hashes(e.block_hashes, as_int),
                medium=e.medium or _MEDIUM_GPU,
                group_idx=e.group_idx,
            )
        return removed_t(block_hashes=_hashes(e.block_hashes, as_int), medium=e.medium or _MEDIUM_GPU)
    return cleared_t()


def _stored_fields_033(e: engine.BlockStored) -> dict[str, Any]:
    return {
        "extra_keys": None
        if e.extra_keys is None
        else [None if k is None else tuple(k) for k in e.extra_keys],
        "group_idx": e.group_idx,
        "kv_cache_spec_kind": e.kv_cache_spec_kind,
        "kv_cache_spec_sliding_window": e.kv_cache_spec_sliding_window,
        "lookahead_token_ids": None
        if e.lookahead_token_ids is None
        else [list(t) for t in e.lookahead_token_ids],
    }


# -- pool configuration ----------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


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
    if kind == "SlidingWindowSpec":
        return pb.KVCacheGroupSpec(
            sliding_window=pb.SlidingWindowSpec(
                block_size=bs,
                sliding_window=int(spec.sliding_window),
                num_kv_heads=heads,
                head_size=head,
                dtype=dtype,
            )  # fmt: skip
        )
    if kind == "ChunkedLocalAttentionSpec":
        return pb.KVCacheGroupSpec(
            chunked_local=pb.ChunkedLocalAttentionSpec(
                block_size=bs,
                attention_chunk_size=int(spec.attention_chunk_size),
                num_kv_heads=heads,
                head_size=head,
                dtype=dtype,
            )  # fmt: skip
        )
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
    if kind == "CrossAttentionSpec":
        return pb.KVCacheGroupSpec(
            cross_attention=pb.CrossAttentionSpec(
                block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype
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
