"""vLLM 0.16.0 on kvcoord: a drop-in ``KVCacheManager`` and scheduler classes.

Importable without vLLM. With vLLM importable, the adapter returns vLLM's own
``PrefixCacheStats`` and KV event types (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so engine-output serialization, the ZMQ event publisher and the
stats loggers take them unchanged; without vLLM it returns kvcoord's plain equivalents
defined here.

Pieces, from the inside out:

- :class:`KVCacheBlocks` / :class:`KVCacheBlock`: what vLLM's ``KVCacheBlocks`` offers the
  scheduler and KV connectors (``+``, ``new_empty``, ``get_block_ids(allow_none)``,
  ``get_unhashed_block_ids``, ``blocks[g][j].block_id`` / ``.block_hash``).
- :func:`pool_config_from_vllm` builds a pool configuration from the engine's
  ``KVCacheConfig`` and ``VllmConfig``; :func:`pool_config_differences` compares two.
- :class:`KVCoordKVCacheManager` wraps a :class:`RemoteKVCacheManager` and has every
  method and attribute vLLM's scheduler, async scheduler and KV connectors use on
  ``KVCacheManager`` (the list, with vLLM source lines, is in docs/vllm-integration.md).
- :func:`connect` creates the pool (or attaches to an existing one) and refuses a pool
  whose layout or settings differ from the engine's (:class:`PoolMismatchError`).
- ``KVCoordScheduler`` / ``KVCoordAsyncScheduler`` (defined only when vLLM is
  importable): vLLM's ``Scheduler`` / ``AsyncScheduler`` whose ``kv_cache_manager`` is
  kvcoord, for ``vllm serve --scheduler-cls kvcoord.client.vllm.KVCoordScheduler``,
  configured by ``KVCOORD_*`` environment variables (see :class:`Settings`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, overload

import grpc
from kvcoord import engine
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import STATS_FIELDS, events_from_pb, group_kinds

from .client import KVCoordClient
from .errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    FencedError,
    KVCoordError,
    LeaseExpiredError,
    NotFoundError,
    PoolBusyError,
    RequestsLostError,
    ResourceExhaustedError,
    SessionExpiredError,
    UnavailableError,
)
from .hashing import RandomSeedError
from .manager import KVCacheBlockIds, RemoteKVCacheManager
from .predicting import PredictingKVCacheManager

__all__ = [
    "OUTAGE_ERRORS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCoordKVCacheManager",
    "PoolMismatchError",
    "PrefixCacheStats",
    "Settings",
    "connect",
    "pool_config_differences",
    "pool_config_from_vllm",
    "vllm_available",
]

_MEDIUM_GPU = "GPU"

logger = logging.getLogger(__name__)

#: Errors that end no request by themselves: the server cannot be reached (or is in a
#: grace period), a lease cannot be vouched for, a session or the pool is gone from a
#: server that restarted, an exclusive session still holds the pool (one whose Attach
#: answer was lost, until its lease ends). The managers turn what they cost into
#: RequestsLostError when they can attach again; until then the scheduler waits and
#: tries again.
OUTAGE_ERRORS = (
    UnavailableError, LeaseExpiredError, FencedError, SessionExpiredError, NotFoundError, PoolBusyError,
)  # fmt: skip


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

    May be lazy (``make``): an allocation answered before its Step was sent builds its
    blocks when first read, which sends the Step if it has not gone yet.
    """

    __slots__ = ("_blocks", "_make")

    def __init__(
        self,
        blocks: tuple[Sequence[KVCacheBlock], ...] | None = None,
        make: Callable[[], tuple[Sequence[KVCacheBlock], ...]] | None = None,
    ) -> None:
        self._blocks = blocks
        self._make = make

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
        return KVCacheBlockIds(tuple([b.block_id for b in group] for group in self.blocks))


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


def _event_types() -> tuple[Any, Any, Any]:
    try:
        from vllm.distributed import kv_events
    except ImportError:
        return BlockStored, BlockRemoved, AllBlocksCleared
    return kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared


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


def convert_stats(stats: pb.PrefixCacheStats) -> Any:
    """A protobuf PrefixCacheStats as vLLM's type (or :class:`PrefixCacheStats`)."""
    out = _stats_type()()
    for name in STATS_FIELDS:
        setattr(out, name, getattr(stats, name))
    return out


def convert_events(events: Iterable[pb.KVEvent]) -> list[Any]:
    """Protobuf KV events as vLLM's event types (or kvcoord's plain ones), in order."""
    return convert_engine_events(events_from_pb(events))


def convert_engine_events(events: Iterable[engine.KVCacheEvent]) -> list[Any]:
    """The engine's KV events as vLLM's event types (or kvcoord's plain ones), in order."""
    stored_t, removed_t, cleared_t = _event_types()
    as_int = _int_hashes()

    def h(raw: bytes) -> bytes | int:
        return int.from_bytes(raw, "big") & ((1 << 64) - 1) if as_int else bytes(raw)

    out: list[Any] = []
    for e in events:
        if isinstance(e, engine.BlockStored):
            out.append(
                stored_t(
                    block_hashes=[h(x) for x in e.block_hashes],
                    parent_block_hash=None if e.parent_block_hash is None else h(e.parent_block_hash),
                    token_ids=list(e.token_ids),
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=e.medium or _MEDIUM_GPU,
                    lora_name=e.lora_name,
                )
            )
        elif isinstance(e, engine.BlockRemoved):
            out.append(removed_t(block_hashes=[h(x) for x in e.block_hashes], medium=e.medium or _MEDIUM_GPU))
        else:
            out.append(cleared_t())
    return out


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


_GROUP_FIELDS = {
    "full": ("block_size", "sink_len"),
    "sliding_window": ("block_size", "sliding_window"),
    "chunked_local": ("block_size", "attention_chunk_size"),
    "mamba": ("block_size", "mamba_cache_mode", "num_speculative_blocks"),
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
    size, caching, EAGLE, events, stats, max_model_len, hash algorithm and seed.
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
    differ("enable_kv_cache_events", expected.enable_kv_cache_events, actual.enable_kv_cache_events)
    differ(
        "log_stats",
        not expected.HasField("log_stats") or expected.log_stats,
        not actual.HasField("log_stats") or actual.log_stats,
    )
    differ("max_model_len", expected.max_model_len, actual.max_model_len)
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


# -- the manager -----------------------------------------------------------------------


def _absorbing(default: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A manager method that, while the manager is ``absorbing``, keeps a loss or an
    outage for the scheduler (``_absorb``) and answers ``default(self, *args)``."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: KVCoordKVCacheManager, *args: Any, **kwargs: Any) -> Any:
            if not self.absorbing:
                return method(self, *args, **kwargs)
            try:
                return method(self, *args, **kwargs)
            except KVCoordError as err:
                self._absorb(err)
                return default(self, *args)

        return call

    return wrap


@dataclasses.dataclass(slots=True)
class _Held:
    """What the adapter knows of a request holding blocks: for ``block_hash``."""

    request: Any
    hashed_tokens: int = 0


class KVCoordKVCacheManager:
    """vLLM 0.16.0's ``KVCacheManager`` interface over a kvcoord pool.

    Every call is one call of the wrapped :class:`RemoteKVCacheManager` (one round trip),
    except those answered locally: ``empty_kv_cache_blocks``, ``create_kv_cache_blocks``,
    ``take_events`` with events off and ``make_prefix_cache_stats`` with stats off.

    ``block_hash`` of a returned block is derived here, not read from the server: a
    request's blocks are hashed up to the tokens cached for it (by ``allocate_slots``,
    or ``cache_blocks`` when caching was delayed), exactly as vLLM's manager caches them,
    with the hash values of ``request.block_hashes``.

    Args:
        remote: an attached manager (see :func:`connect`).
        kv_cache_config: the engine's ``KVCacheConfig`` (kept as ``kv_cache_config``).
    """

    def __init__(
        self, remote: RemoteKVCacheManager | PredictingKVCacheManager, kv_cache_config: Any = None
    ) -> None:
        cfg = remote.config
        self.remote = remote
        self.kv_cache_config = kv_cache_config
        self.enable_caching = bool(cfg.enable_caching)
        self.use_eagle = bool(cfg.use_eagle)
        self.log_stats = not cfg.HasField("log_stats") or cfg.log_stats
        self.enable_kv_cache_events = bool(cfg.enable_kv_cache_events)
        self.max_model_len = int(cfg.max_model_len)
        self.hash_block_size = int(cfg.hash_block_size)
        self.num_kv_cache_groups = len(cfg.groups)
        kinds = group_kinds(cfg.groups)
        self.block_sizes = [int(getattr(g, k).block_size) for g, k in zip(cfg.groups, kinds, strict=True)]
        # attention tables hold one block per block_size tokens from position 0, so a
        # block's position says which hash it holds; mamba and cross-attention tables
        # do not, and their blocks report no hash
        self._positional = [k in ("full", "sliding_window", "chunked_local") for k in kinds]
        self.metrics_collector = None
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._held: dict[str, _Held] = {}
        #: whole tables that came with a request's first allocation, until it changes
        self._tables: dict[str, KVCacheBlockIds] = {}
        #: blocks whose hash evict_blocks dropped: they report none until allocated anew
        #: (a request holding one never caches it again); and, while there are any, the
        #: allocations whose new ids were not read yet (read before hashes are given)
        self._evicted: set[int] = set()
        self._unread: list[KVCacheBlockIds] = []
        #: closed by close() (set by connect when it opened the client)
        self.owned_client: KVCoordClient | None = None
        #: the pool's name and configuration, to create it again on a server that lost
        #: it (set by connect with KVCOORD_CREATE_POOL=1)
        self.pool_to_create: tuple[str, pb.PoolConfig] | None = None
        #: the requests allocate_slots was called for since the scheduler last cleared
        #: it (what a schedule() call that failed half-way may have allocated), and the
        #: scheduling fields of each waiting request looked up or allocated for, as they
        #: were at its first such call since then (what that call may have changed after)
        self.allocated: set[str] = set()
        self.seen: dict[str, tuple[Any, ...]] = {}
        #: while True (vLLM's update_from_output, whose outputs must not be lost), a
        #: lost session or an outage does not raise: the requests reported lost go to
        #: ``lost`` for the scheduler to preempt before its next allocation, and the
        #: call answers as if it had nothing to say (no events, no statistics, no
        #: blocks, the last usage known)
        self.absorbing = False
        self.lost: set[str] = set()
        #: losses and outages met while absorbing
        self.absorbed = 0
        self._last_usage = 0.0
        #: the remote's shared answer to an allocation that takes no block (predicted)
        self._no_blocks: KVCacheBlockIds | None = getattr(remote, "no_blocks", None)

    # -- blocks -------------------------------------------------------------------------
    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> KVCacheBlocks:
        """``KVCacheBlocks`` of ``blocks`` (the shared empty one when all groups are empty)."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def _blocks(
        self, ids: Sequence[Sequence[int]], held: _Held | None, starts: Sequence[int]
    ) -> KVCacheBlocks:
        """Blocks for ``ids``; ``starts[g]`` is the table position of group ``g``'s first."""
        if not any(ids):
            return self.empty_kv_cache_blocks
        if held is None or not self.enable_caching:
            return KVCacheBlocks(tuple([KVCacheBlock(b) for b in group] for group in ids))
        if self._unread:
            unread, self._unread = self._unread, []
            for new in unread:  # after an eviction only: their ids may say a block was given anew
                self._allocated_anew(new.get_block_ids())
        return KVCacheBlocks(
            tuple(
                [KVCacheBlock(b, self._hash_of(held, g, starts[g] + j, b)) for j, b in enumerate(group)]
                for g, group in enumerate(ids)
            )
        )

    def _hash_of(self, held: _Held, group: int, index: int, block_id: int) -> bytes | None:
        size = self.block_sizes[group]
        if not self._positional[group] or block_id == 0 or (index + 1) * size > held.hashed_tokens:
            return None
        if self._evicted and block_id in self._evicted:
            return None  # its hash was dropped (evict_blocks) while held, as vLLM's block
        hashes = getattr(held.request, "block_hashes", None) or ()
        scale = size // self.hash_block_size
        parts = hashes[index * scale : (index + 1) * scale]
        if len(parts) < scale:
            return None
        return b"".join(bytes(p) for p in parts) + group.to_bytes(4, "big")

    # -- losses ---------------------------------------------------------------------------
    def _absorb(self, err: KVCoordError) -> None:
        """Keep what ``err`` says for the scheduler (while ``absorbing``), or raise it."""
        if isinstance(err, RequestsLostError):
            self.lost.update(err.request_ids)
        elif not isinstance(err, OUTAGE_ERRORS):
            raise err
        self.absorbed += 1
        logger.warning("kvcoord pool %r: %s (handled at the next schedule)", self.remote.pool, err)

    def take_lost(self) -> set[str]:
        """The requests reported lost while absorbing, since the last call."""
        lost, self.lost = self.lost, set()
        return lost

    def create_pool_again(self) -> bool:
        """Create the pool (as connect did) on a server that no longer has it; False when
        this manager was not told how (KVCOORD_CREATE_POOL=0)."""
        if self.pool_to_create is None:
            return False
        name, config = self.pool_to_create
        try:
            self.remote.client.create_pool(name, config)
        except AlreadyExistsError:
            pass  # made meanwhile (by another engine, or the call's own retry)
        logger.warning("kvcoord pool %r was gone from the server: created again", name)
        return True

    # -- KVCacheManager -----------------------------------------------------------------
    @property
    def usage(self) -> float:
        if not self.absorbing:
            self._last_usage = usage = self.remote.usage
            return usage
        try:
            self._last_usage = usage = self.remote.usage
        except KVCoordError as err:
            self._absorb(err)
            return self._last_usage
        return usage

    @property
    def prefix_cache_stats(self) -> Any:
        """The statistics gathered since the last ``make_prefix_cache_stats`` (not reset)."""
        if not self.log_stats:
            return None
        return convert_stats(self.remote.peek_prefix_cache_stats() or pb.PrefixCacheStats())

    @_absorbing(lambda self, *_: convert_stats(pb.PrefixCacheStats()) if self.log_stats else None)
    def make_prefix_cache_stats(self) -> Any:
        """Get (and reset) the prefix cache stats; ``None`` with stats off."""
        if not self.log_stats:
            return None
        stats = self.remote.make_prefix_cache_stats()
        return convert_stats(stats if stats is not None else pb.PrefixCacheStats())

    def _seen(self, request: Any) -> None:
        if request.request_id not in self.seen:
            self.seen[request.request_id] = (
                getattr(request, "status", None), request.num_computed_tokens,
                getattr(request, "num_cached_tokens", -1), getattr(request, "num_external_computed_tokens", 0),
            )  # fmt: skip

    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int]:
        self._seen(request)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.empty_kv_cache_blocks, 0
        hit, num_tokens = self.remote.get_computed_blocks(request)
        ids = hit.get_block_ids()
        if not any(ids):
            return self.empty_kv_cache_blocks, num_tokens
        # hit blocks are cached blocks: each one holds its hash
        held = _Held(request, num_tokens)
        groups = tuple(
            [KVCacheBlock(b, self._hash_of(held, g, j, b)) for j, b in enumerate(group)]
            for g, group in enumerate(ids)
        )
        return KVCacheBlocks(groups), num_tokens

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        hit = new_computed_blocks.to_block_ids() if new_computed_blocks is not None else None
        rid = request.request_id
        if new_computed_blocks is not None:  # vLLM's waiting loop (a running request's passes none)
            self._seen(request)
        self.allocated.add(rid)
        held = self._held.get(rid)
        fresh = held is None  # vLLM will ask for its whole table (get_blocks)
        new = self.remote.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, hit, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, return_table=fresh,
        )  # fmt: skip
        tables = self._tables
        if tables:
            tables.pop(rid, None)
        if new is None:
            return None
        if held is None:
            tables[rid] = new
            held = self._held[rid] = _Held(request)
        else:
            held.request = request
        # vLLM's accounting: what is computed, what needs a slot, what gets cached
        local = int(request.num_computed_tokens) + num_new_computed_tokens
        total = local + num_external_computed_tokens
        need = total + num_new_tokens + num_lookahead_tokens
        if self.max_model_len:
            total, need = min(total, self.max_model_len), min(need, self.max_model_len)
        if self.enable_caching:
            cached = local if delay_cache_blocks else min(total + num_new_tokens, int(request.num_tokens))
            if cached > held.hashed_tokens:
                held.hashed_tokens = cached
        if new is self._no_blocks:
            return self.empty_kv_cache_blocks  # a decode step inside its last block, as vLLM answers it

        def make() -> tuple[Sequence[KVCacheBlock], ...]:
            ids = new.get_block_ids()
            self._allocated_anew(ids)
            if not any(ids):
                return self.empty_kv_cache_blocks.blocks  # a decode step's usual answer
            # tables only grow: new blocks end the table, which now covers `need` tokens
            starts = [
                -(-need // size) - len(group) for size, group in zip(self.block_sizes, ids, strict=True)
            ]
            return self._blocks(ids, held, starts).blocks

        if new.resolved:
            blocks = make()
            # no new block (a decode step inside its last block): vLLM's shared empty answer
            return (
                self.empty_kv_cache_blocks
                if blocks is self.empty_kv_cache_blocks.blocks
                else KVCacheBlocks(blocks)
            )
        if self._evicted:
            self._unread.append(new)
        return KVCacheBlocks(make=make)

    def _allocated_anew(self, ids: Sequence[Sequence[int]]) -> None:
        """Blocks just allocated report their new holder's hashes again."""
        if self._evicted:
            for group in ids:
                self._evicted.difference_update(group)

    @_absorbing(lambda *_: None)
    def free(self, request: Any) -> None:
        self._held.pop(request.request_id, None)
        self._tables.pop(request.request_id, None)
        self.remote.free(request)

    @_absorbing(lambda *_: None)
    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        if request_id not in self._held:
            return  # vLLM's scheduler asks for any finished request (a connector's): no table, nothing to skip
        self._tables.pop(request_id, None)
        self.remote.remove_skipped_blocks(request_id, total_computed_tokens)

    @_absorbing(lambda *_: None)
    def evict_blocks(self, block_ids: set[int]) -> None:
        self.remote.evict_blocks(block_ids)
        self._evicted.update(block_ids)

    def reset_prefix_cache(self) -> bool:
        try:
            return self.remote.reset_prefix_cache()
        except RequestsLostError as err:
            # the session was lost (the manager is attached again): the scheduler
            # preempts the requests before its next allocation; the reset is tried anew
            self.lost.update(err.request_ids)
            return self.remote.reset_prefix_cache()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return self.remote.get_num_common_prefix_blocks(running_request_id)

    @_absorbing(lambda *_: [])
    def take_events(self) -> list[Any]:
        if not self.enable_kv_cache_events:
            return []
        remote = self.remote
        if isinstance(remote, PredictingKVCacheManager):
            return convert_engine_events(remote.take_engine_events())  # no message made and read
        return convert_events(remote.take_events())

    @_absorbing(lambda self, *_: self.empty_kv_cache_blocks)
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        held = self._held.get(request_id)
        if held is None:
            # never allocated here, or freed: vLLM's manager holds no table for it
            return self.empty_kv_cache_blocks
        fresh = self._tables.get(request_id)
        if fresh is not None:
            # the table came with the request's first allocation (nothing changed it since)
            def make() -> tuple[Sequence[KVCacheBlock], ...]:
                table = fresh.table
                assert table is not None
                return self._blocks(table, held, [0] * len(table)).blocks

            return KVCacheBlocks(make=make)
        ids = self.remote.get_block_ids(request_id)
        return self._blocks(ids, held, [0] * len(ids))

    @_absorbing(lambda self, *_: tuple([] for _ in range(self.num_kv_cache_groups)))
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self._held:
            # never allocated here, or freed (vLLM's scheduler asks when a connector's
            # request finishes, scheduled or not): no table, as vLLM answers
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self.remote.get_block_ids(request_id)

    @_absorbing(lambda *_: None)
    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.remote.cache_blocks(request, num_computed_tokens)
        held = self._held.get(request.request_id)
        if held is not None:
            held.hashed_tokens = max(held.hashed_tokens, num_computed_tokens)

    def close(self) -> None:
        """End the session (the server frees what it still holds) and close an owned client."""
        try:
            self.remote.close()
        finally:
            if self.owned_client is not None:
                self.owned_client.close()


# -- connecting ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Where an engine's KV cache pool lives; :meth:`from_env` reads ``KVCOORD_*``.

    Attributes:
        target: ``host:port`` or ``unix:/path`` of the kvcoord server (``KVCOORD_TARGET``).
        pool: the pool's name (``KVCOORD_POOL``, default ``vllm``).
        token: bearer token when the server sets ``auth_tokens`` (``KVCOORD_TOKEN``).
        create_pool: create the pool from the engine's ``KVCacheConfig`` when it does not
            exist (``KVCOORD_CREATE_POOL``, default ``1``); ``0`` only attaches.
        timeout: deadline of each call in seconds (``KVCOORD_TIMEOUT``, default 10).
        client_name: shown in server logs (``KVCOORD_CLIENT_NAME``, default host:pid).
        exclusive: the engine is the pool's only session (``KVCOORD_EXCLUSIVE``, default
            ``1``): allocations it can prove will succeed are answered without a round
            trip; ``0`` lets several engines share the pool (one round trip per call).
        predict: answer every call from a mirror of the pool (the engine itself, loaded
            from the server) and never wait (``KVCOORD_PREDICT``, default ``1``; needs
            ``exclusive``): a :class:`PredictingKVCacheManager`, for every layout. When
            the server gives no state this client can mirror (an engine of another
            kvcoord release, a state larger than one answer), a warning says why and
            the engine runs as without it (as ``exclusive`` says).
        max_outage: seconds the scheduler keeps trying again while the server cannot be
            reached, is in its grace period or has lost the pool
            (``KVCOORD_MAX_OUTAGE``, default 600); then the error reaches vLLM.
    """

    target: str
    pool: str = "vllm"
    token: str | None = dataclasses.field(default=None, repr=False)  # a secret: never printed
    create_pool: bool = True
    timeout: float = 10.0
    client_name: str = ""
    exclusive: bool = True
    predict: bool = True
    max_outage: float = 600.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        target = e.get("KVCOORD_TARGET", "")
        if not target:
            raise ValueError("KVCOORD_TARGET is not set: give the kvcoord server's host:port")
        return cls(
            target=target,
            pool=e.get("KVCOORD_POOL", "vllm") or "vllm",
            token=e.get("KVCOORD_TOKEN") or None,
            create_pool=e.get("KVCOORD_CREATE_POOL", "1").lower() not in ("0", "false", "no"),
            timeout=float(e.get("KVCOORD_TIMEOUT", "10")),
            client_name=e.get("KVCOORD_CLIENT_NAME", "") or f"{os.uname().nodename}:{os.getpid()}",
            exclusive=e.get("KVCOORD_EXCLUSIVE", "1").lower() not in ("0", "false", "no"),
            predict=e.get("KVCOORD_PREDICT", "1").lower() not in ("0", "false", "no", ""),
            max_outage=float(e.get("KVCOORD_MAX_OUTAGE", "600")),
        )


def connect(
    settings: Settings,
    kv_cache_config: Any,
    vllm_config: Any,
    *,
    log_stats: bool = True,
    client: KVCoordClient | None = None,
) -> KVCoordKVCacheManager:
    """Create or find the pool, check it matches the engine, attach, wrap.

    Args:
        settings: where the pool is.
        kv_cache_config, vllm_config, log_stats: the engine's, as its scheduler gets them.
        client: an existing client to use (else one is opened from ``settings``).

    Raises:
        PoolMismatchError: the pool exists with other settings (each difference named).
        RandomSeedError: prefix caching is on and ``PYTHONHASHSEED`` is not set.
        KVCoordError: the server refused or could not be reached.
    """
    expected = pool_config_from_vllm(kv_cache_config, vllm_config, log_stats=log_stats)
    if expected.enable_caching and not expected.hash_seed:
        raise RandomSeedError(
            "PYTHONHASHSEED is not set: vLLM then hashes blocks with a random seed no other "
            "process shares; set it (to the same value) for the engine"
        )
    own = client is None
    c = (
        client
        if client is not None
        else KVCoordClient(settings.target, timeout=settings.timeout, token=settings.token)
    )
    try:
        if settings.create_pool:
            try:
                c.create_pool(settings.pool, expected)
            except AlreadyExistsError:
                pass  # a different pool of that name: compared (and refused) below
        actual = c.get_pool(settings.pool).pool.config
        diffs = pool_config_differences(expected, actual)
        if diffs:
            raise PoolMismatchError(settings.pool, diffs)
        remote: RemoteKVCacheManager | PredictingKVCacheManager | None = None
        # Prediction needs the pool to itself: with KVCOORD_EXCLUSIVE=0 the engine shares
        # it and waits for the server, as asked (no warning: nothing is missing).
        why: str | None = None
        if settings.predict and settings.exclusive:
            try:
                remote = PredictingKVCacheManager(
                    c, settings.pool, hash_seed=expected.hash_seed, client_name=settings.client_name
                )
            except (FailedPreconditionError, ResourceExhaustedError) as err:
                if isinstance(err, PoolBusyError) or (
                    isinstance(err, ResourceExhaustedError) and err.reason != "ANSWER_TOO_LARGE"
                ):
                    raise
                why = err.message  # the server gives no state for this pool (or not in one answer)
        if why is not None:
            logger.warning(
                "KVCOORD_PREDICT: pool %r is not predicted (%s); running without prediction",
                settings.pool,
                why,
            )
        if remote is None:
            remote = RemoteKVCacheManager(
                c,
                settings.pool,
                hash_seed=expected.hash_seed,
                client_name=settings.client_name,
                exclusive=settings.exclusive,
            )
    except BaseException:
        if own:
            c.close()
        raise
    manager = KVCoordKVCacheManager(remote, kv_cache_config)
    manager.owned_client = c if own else None
    if settings.create_pool:
        manager.pool_to_create = (settings.pool, expected)
    return manager
