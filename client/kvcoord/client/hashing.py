"""vLLM-compatible block hashes, computed where the tokens are.

A block hash chains the previous block's hash, the block's token ids and optional
extra keys (LoRA name, multimodal identifiers, cache salt, prompt-embedding bytes)::

    hash_i = F(encode((parent_i, tuple(tokens of block i), extra_keys_i)))

with ``parent_0 = NONE_HASH``, the hash of the seed string (vLLM reads it from
``PYTHONHASHSEED``). Four functions are supported, as in vLLM: ``sha256`` and
``xxhash`` over ``pickle`` protocol 5 (reproducible only from CPython), and
``sha256_cbor`` and ``xxhash_cbor`` over canonical CBOR (language-independent).

This module imports nothing from the server side.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

__all__ = [
    "pool_seed",
    "HASH_ALGORITHMS",
    "BlockHasher",
    "MultiModalItem",
    "RandomSeedError",
    "hash_block_tokens",
    "hash_function",
    "none_hash",
]


class RandomSeedError(ValueError):
    """No seed was given: a random ``NONE_HASH`` can never match another process."""


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_pickle(obj: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=5))


def _xxhash_cbor(obj: Any) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_ALGORITHMS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}
"""Hash function by name; digests are 32 bytes (sha256*) or 16 bytes (xxhash*)."""


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The hash function called ``algo``.

    Raises:
        ValueError: unknown name.
    """
    try:
        return HASH_ALGORITHMS[algo]
    except KeyError:
        raise ValueError(
            f"unknown hash algorithm {algo!r}; choose one of {sorted(HASH_ALGORITHMS)}"
        ) from None


def pool_seed(config: Any, hash_seed: str | None) -> tuple[str | None, bytes]:
    """The seed a worker of this pool hashes with (``hash_seed``, else
    ``$PYTHONHASHSEED``) and its parent hash of first blocks (``b""`` without caching).

    Raises:
        RandomSeedError: caching is on and no seed is known.
    """
    seed = hash_seed if hash_seed is not None else os.environ.get("PYTHONHASHSEED")
    if not config.enable_caching:
        return seed, b""
    if seed is None:
        raise RandomSeedError(
            "no hash seed: set PYTHONHASHSEED (or pass hash_seed) to the value the vLLM workers use"
        )
    return seed, none_hash(config.hash_algo, seed)


def none_hash(algo: str, seed: str | None, *, allow_random: bool = False) -> bytes:
    """The parent hash of every first block.

    Args:
        algo: hash algorithm name.
        seed: vLLM's ``PYTHONHASHSEED`` string; ``None`` means unset.
        allow_random: with no seed, return 32 random bytes as vLLM does. Such hashes
            never match another process, so this is refused unless asked for.

    Raises:
        RandomSeedError: ``seed`` is ``None`` and ``allow_random`` is false.
    """
    if seed is None:
        if not allow_random:
            raise RandomSeedError(
                "no hash seed: set PYTHONHASHSEED (as the vLLM workers do) so that block "
                "hashes are the same in every process"
            )
        return os.urandom(32)
    return hash_function(algo)(seed)


def hash_block_tokens(
    fn: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None,
    none: bytes,
) -> bytes:
    """One block's hash. An empty or missing parent becomes ``none``."""
    return fn((parent_block_hash or none, tuple(token_ids), extra_keys))


@dataclasses.dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input: its identifier and the token span it occupies."""

    identifier: str
    offset: int
    length: int


class BlockHasher:
    """Incremental block hashes of one request, exactly as vLLM computes them.

    vLLM hashes the whole prompt when a request is created and then, each time
    tokens are appended, only the blocks that became full. The multimodal cursor of
    a later invocation starts at the *last* item, so call :meth:`extend` once per
    append, as vLLM does (without multimodal items the split does not matter).

    Args:
        algo: hash algorithm name (see :data:`HASH_ALGORITHMS`).
        block_size: tokens per hashed block (vLLM's ``cache_config.block_size``).
        none: the seed hash, from :func:`none_hash`.
        lora_name: LoRA adapter name, added to every block's extra keys.
        cache_salt: added to the first block's extra keys when non-empty.
        mm_items: multimodal items, sorted by offset.
        prompt_embeds: one bytes row per prompt token, when the request has them.
    """

    def __init__(
        self,
        algo: str,
        block_size: int,
        none: bytes,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        prompt_embeds: Sequence[bytes] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._fn = hash_function(algo)
        self.block_size = block_size
        self._none = none
        self._lora_name = lora_name
        self._cache_salt = cache_salt
        self._mm = sorted(mm_items, key=lambda m: m.offset)
        self._embeds = prompt_embeds
        self.token_ids: list[int] = []
        self.block_hashes: list[bytes] = []

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Append tokens; return the hashes of the blocks they completed."""
        self.token_ids.extend(token_ids)
        bs = self.block_size
        start = len(self.block_hashes) * bs
        if start + bs > len(self.token_ids):
            return []
        mm_idx = -1 if start > 0 else 0
        parent = self.block_hashes[-1] if self.block_hashes else None
        new: list[bytes] = []
        while start + bs <= len(self.token_ids):
            end = start + bs
            extra, mm_idx = self._extra_keys(start, end, mm_idx)
            parent = hash_block_tokens(self._fn, parent, self.token_ids[start:end], extra, self._none)
            new.append(parent)
            start = end
        self.block_hashes.extend(new)
        return new

    def truncate(self, num_tokens: int) -> None:
        """Forget the tokens from ``num_tokens`` on, and the hashes of the blocks they
        were part of (the next :meth:`extend` hashes from there again)."""
        del self.token_ids[num_tokens:]
        del self.block_hashes[num_tokens // self.block_size :]

    def _extra_keys(self, start: int, end: int, mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
        keys: list[Any] = []
        if self._lora_name:
            keys.append(self._lora_name)
        mm_keys, mm_idx = self._mm_keys(start, end, mm_idx)
        keys.extend(mm_keys)
        if start == 0 and self._cache_salt:
            keys.append(self._cache_salt)
        if self._embeds is not None:
            keys.append(b"".join(self._embeds[start:end]))
        return (tuple(keys) if keys else None), mm_idx

    def _mm_keys(self, start: int, end: int, idx: int) -> tuple[list[str], int]:
        items = self._mm
        if not items:
            return [], idx
        last = items[-1]
        if last.offset + last.length < start:
            return [], idx
        if idx < 0:
            idx += len(items)
        keys: list[str] = []
        while idx < len(items):
            item = items[idx]
            if end <= item.offset:
                break
            if start > item.offset + item.length:
                idx += 1
                continue
            keys.append(item.identifier)
            if end >= item.offset + item.length:
                idx += 1
            else:
                break
        return keys, idx
