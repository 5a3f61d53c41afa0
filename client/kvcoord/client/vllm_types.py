"""vLLM's types as kvcoord gives them, importable without vLLM: the blocks the
scheduler and KV connectors read (:class:`KVCacheBlocks`), the statistics and KV events
(vLLM's own types when importable, plain equivalents here otherwise); the pool
configuration built from vLLM's configs is :mod:`.vllm_pool_config`'s.
:mod:`kvcoord.client.vllm` wraps a session in vLLM's manager interface with them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, overload

from kvcoord import engine
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import STATS_FIELDS, events_from_pb

from .manager import KVCacheBlockIds

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheBlock",
    "KVCacheBlocks",
    "PrefixCacheStats",
    "convert_engine_events",
    "convert_events",
    "convert_stats",
    "zero_stats",
    "event_converter",
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
    without building them (what vLLM's scheduler reads of most answers); given alone
    (no ``blocks``, no ``make``), the blocks are those ids' blocks holding no hash,
    built when first read.
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
            make = self._make
            if make is None:  # (the ids alone: no closure made per answer for them)
                ids = self._ids
                assert ids is not None
                self._blocks = tuple([KVCacheBlock(b) for b in group] for group in ids)
            else:
                self._blocks, self._make = make(), None
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


#: vLLM's ``PrefixCacheStats`` fields, for when vLLM is not importable: the engine's own
PrefixCacheStats = engine.PrefixCacheStats


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
    """vLLM's PrefixCacheStats type, or kvcoord's without vLLM (looked up once)."""
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


def zero_stats() -> Any:
    """:func:`convert_stats` of all-zero statistics (vLLM's type's defaults)."""
    return _stats_type()()


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
        more = {"group_idx": e.group_idx} if fields_033 else {}
        return removed_t(block_hashes=_hashes(e.block_hashes, as_int), medium=e.medium or _MEDIUM_GPU, **more)
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
