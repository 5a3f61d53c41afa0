"""KV cache events, as vLLM's block pool queues them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent", "hash_to_int64"]

MEDIUM_GPU = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of newly full blocks of one group became cache hits.

    ``block_hashes`` and ``parent_block_hash`` are raw hash bytes at the group's
    granularity (merged hashes for groups with larger blocks), without group id.
    ``cache_prefix`` is the key prefix of the cache namespace the blocks were cached in
    (``b""``: the default namespace, vLLM's keys); it never leaves the server, which
    uses it to give each session only its own namespace's events.

    The last fields are set by vllm-0.33 pools only (``None`` in 0.16 pools, as vLLM
    0.16 has no such fields): ``extra_keys``, one entry per block of the run (its
    untagged extra keys as a tuple, or ``None``); ``group_idx``; the group's
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``; with look-ahead
    hashes, ``lookahead_token_ids``: per block, the tokens after it its hash covers.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    medium: str = MEDIUM_GPU
    cache_prefix: bytes = b""
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None

    def __setstate__(self, state: list[object]) -> None:
        _set_fields(self, state)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks lost their hash (reused from the free queue, or evicted).

    ``cache_prefix``: the cache namespace they were cached in, as in :class:`BlockStored`.
    ``group_idx``: the block's group, in vllm-0.33 pools only.
    """

    block_hashes: tuple[bytes, ...]
    medium: str = MEDIUM_GPU
    cache_prefix: bytes = b""
    group_idx: int | None = None

    def __setstate__(self, state: list[object]) -> None:
        _set_fields(self, state)


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """A successful prefix-cache reset forgot every cached hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _set_fields(event: BlockStored | BlockRemoved, state: list[object]) -> None:
    """Unpickle a frozen event (snapshots keep events): a field that a snapshot of an
    older kvcoord lacks (``cache_prefix``) gets its default."""
    for i, f in enumerate(dataclasses.fields(event)):
        object.__setattr__(event, f.name, state[i] if i < len(state) else f.default)


_new = object.__new__
_set_removed_hashes: Callable[[BlockRemoved, tuple[bytes, ...]], None] = vars(BlockRemoved)[
    "block_hashes"
].__set__
_set_removed_medium: Callable[[BlockRemoved, str], None] = vars(BlockRemoved)["medium"].__set__
_set_removed_prefix: Callable[[BlockRemoved, bytes], None] = vars(BlockRemoved)["cache_prefix"].__set__
_set_removed_group: Callable[[BlockRemoved, int | None], None] = vars(BlockRemoved)["group_idx"].__set__


def block_removed(block_hash: bytes, cache_prefix: bytes = b"", group_idx: int | None = None) -> BlockRemoved:
    """``BlockRemoved(block_hashes=(block_hash,), cache_prefix=cache_prefix, group_idx=...)``, built without the frozen dataclass's
    ``__init__`` (one per evicted block; the generated one costs several times more).

    The slots are written through their member descriptors, exactly what the generated
    ``__init__`` ends up doing, so the result is equal to the normally built event.
    """
    event: BlockRemoved = _new(BlockRemoved)
    _set_removed_hashes(event, (block_hash,))
    _set_removed_medium(event, MEDIUM_GPU)
    _set_removed_prefix(event, cache_prefix)
    _set_removed_group(event, group_idx)
    return event


(
    _set_hashes,
    _set_parent,
    _set_tokens,
    _set_size,
    _set_lora_id,
    _set_lora_name,
    _set_medium,
    _set_prefix,
    *_set_033_fields,
) = (vars(BlockStored)[f.name].__set__ for f in dataclasses.fields(BlockStored))


def block_stored(
    block_hashes: tuple[bytes, ...],
    parent_block_hash: bytes | None,
    token_ids: tuple[int, ...],
    block_size: int,
    lora_id: int | None,
    lora_name: str | None,
    cache_prefix: bytes = b"",
) -> BlockStored:
    """``BlockStored(...)`` of a vllm-0.16 pool (vLLM 0.33's fields ``None``), built
    without the frozen dataclass's ``__init__`` as :func:`block_removed` is (one per
    run of blocks cached: the generated one costs several times more); equal to the
    normally built event."""
    event: BlockStored = _new(BlockStored)
    _set_hashes(event, block_hashes)
    _set_parent(event, parent_block_hash)
    _set_tokens(event, token_ids)
    _set_size(event, block_size)
    _set_lora_id(event, lora_id)
    _set_lora_name(event, lora_name)
    _set_medium(event, MEDIUM_GPU)
    _set_prefix(event, cache_prefix)
    for put in _set_033_fields:
        put(event, None)
    return event


def hash_to_int64(block_hash: bytes) -> int:
    """vLLM's integer form of a hash in events: the last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")
