"""vLLM-compatible block hashes, computed where the tokens are.

A block hash chains the previous block's hash, the block's token ids and optional
extra keys (LoRA name, multimodal identifiers, cache salt, prompt-embedding bytes)::

    hash_i = F(encode((parent_i, tuple(tokens of block i), extra_keys_i)))

with ``parent_0 = NONE_HASH``, the hash of the seed string (vLLM reads it from
``PYTHONHASHSEED``). Four functions are supported, as in vLLM: ``sha256`` and
``xxhash`` over ``pickle`` protocol 5 (reproducible only from CPython), and
``sha256_cbor`` and ``xxhash_cbor`` over canonical CBOR (language-independent).

Two semantics profiles hash differently (:func:`block_hasher` picks the class):

- ``vllm-0.16`` (:class:`BlockHasher`): extra keys are bare values (LoRA name,
  multimodal identifier, cache salt, raw prompt-embedding bytes).
- ``vllm-0.33`` (:class:`BlockHasher033`): tagged extra keys ``("lora", name,
  path)``, ``("mm", identifier, offset in block)``, ``("cache_salt", salt)``,
  ``("prompt_embeds", sha256 digest)``; with ``num_hash_lookahead_tokens`` L > 0
  (EAGLE/MTP) each hash also covers the next L tokens (extra keys ``(E, *tokens)``)
  and exists only once they do; and without a seed, sha256 pools derive ``NONE_HASH``
  from ``"vllm-none-hash"``.

This module imports nothing from the server side.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
from kvcoord.engine.extra_keys import MultiModalItem, block_extra_keys_033

__all__ = [
    "pool_seed",
    "HASH_ALGORITHMS",
    "BlockHasher",
    "BlockHasher033",
    "MultiModalItem",
    "block_hasher",
    "RandomSeedError",
    "hash_block_tokens",
    "hash_function",
    "none_hash",
    "prompt_embeds_digests",
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


#: vLLM 0.29+'s seed of NONE_HASH for sha256 and sha256_cbor when PYTHONHASHSEED is unset
DEFAULT_NONE_HASH_SEED_033 = "vllm-none-hash"


def none_hash(
    algo: str, seed: str | None, *, allow_random: bool = False, profile: str = "vllm-0.16"
) -> bytes:
    """The parent hash of every first block.

    Args:
        algo: hash algorithm name.
        seed: vLLM's ``PYTHONHASHSEED`` string; ``None`` means unset.
        allow_random: with no seed, return 32 random bytes as vLLM does. Such hashes
            never match another process, so this is refused unless asked for.
        profile: ``"vllm-0.33"``: with no seed, sha256 and sha256_cbor hash the fixed
            string ``"vllm-none-hash"`` (vLLM 0.29+); xxhash stays random.

    Raises:
        RandomSeedError: ``seed`` is ``None`` and ``allow_random`` is false (and the
            profile gives no fixed seed for ``algo``).
    """
    if seed is None and profile == "vllm-0.33" and algo in ("sha256", "sha256_cbor"):
        seed = DEFAULT_NONE_HASH_SEED_033
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

    #: tokens after a block its hash covers too (vllm-0.33's look-ahead: BlockHasher033)
    _lookahead = 0

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Append tokens; return the hashes of the blocks that became hashable (full,
        and followed by the look-ahead tokens their hashes cover)."""
        tokens = self.token_ids
        tokens.extend(token_ids)
        bs = self.block_size
        start = len(self.block_hashes) * bs
        limit = len(tokens) - self._lookahead
        if start + bs > limit:
            return []
        mm_idx = -1 if start > 0 else 0  # (a later call's multimodal cursor starts at the last item)
        parent = self.block_hashes[-1] if self.block_hashes else None
        new: list[bytes] = []
        while start + bs <= limit:
            end = start + bs
            extra, mm_idx = self._extra_keys(start, end, mm_idx)
            parent = hash_block_tokens(self._fn, parent, tokens[start:end], extra, self._none)
            new.append(parent)
            start = end
        self.block_hashes.extend(new)
        return new

    def truncate(self, num_tokens: int) -> None:
        """Forget the tokens from ``num_tokens`` on, and the hashes that covered any of
        them (the next :meth:`extend` hashes from there again)."""
        del self.token_ids[num_tokens:]
        del self.block_hashes[max(num_tokens - self._lookahead, 0) // self.block_size :]

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


class BlockHasher033(BlockHasher):
    """Incremental block hashes of one request as vLLM 0.33.0 computes them.

    Same chaining as :class:`BlockHasher` (``hash_i = F((parent, tokens_i, extra_i))``),
    with 0.33's extra keys: ``("lora", name, path)`` on every block, then
    ``("mm", identifier, offset - block start)`` for each multimodal item the block
    overlaps, then ``("cache_salt", salt)`` on the first block, then
    ``("prompt_embeds", sha256(embedding bytes of the block))``. With
    ``num_hash_lookahead_tokens`` L > 0 a block's hash also covers the L tokens after
    it: its extra keys are ``(E, *those tokens)`` (``(E, token)`` for L = 1), where E
    are the keys above computed over the block and those tokens, and the hash exists
    only once the L tokens do.

    Args:
        algo, block_size, none, lora_name, cache_salt, mm_items, prompt_embeds
            (``keys``): as :class:`BlockHasher`'s (``block_size``: vLLM's
            ``hash_block_size``; multimodal items not overlapping).
        lora_path: the adapter's path (part of the key since vLLM 0.31).
        num_hash_lookahead_tokens: L (1 for EAGLE/MTP with caching and no KV connector).
    """

    def __init__(
        self,
        algo: str,
        block_size: int,
        none: bytes,
        *,
        lora_path: str | None = None,
        num_hash_lookahead_tokens: int = 0,
        **keys: Any,
    ) -> None:
        if num_hash_lookahead_tokens < 0:
            raise ValueError(f"num_hash_lookahead_tokens must be >= 0, got {num_hash_lookahead_tokens}")
        if keys.get("lora_name") and lora_path is None:
            raise ValueError("a LoRA's path is part of vLLM 0.33's block hash: pass lora_path")
        super().__init__(algo, block_size, none, **keys)
        self._lora = ("lora", self._lora_name, lora_path) if self._lora_name else None
        self._lookahead = num_hash_lookahead_tokens

    def _extra_keys(self, start: int, end: int, mm_idx: int) -> tuple[Any, int]:
        """The block's tagged extra keys, followed by its look-ahead tokens when it has
        any (the multimodal cursor is not used: items are found by offset)."""
        look = self._lookahead
        if not look:
            return self.block_extra_keys(start, end), mm_idx
        keys = self.block_extra_keys(start, end + look)
        tokens = self.token_ids
        return ((keys, tokens[end]) if look == 1 else (keys, *tokens[end : end + look])), mm_idx

    def block_extra_keys(self, start: int, end: int) -> tuple[Any, ...] | None:
        """The tagged extra keys of the span ``[start, end)`` (the block and its
        look-ahead tokens): :func:`kvcoord.engine.extra_keys.block_extra_keys_033`."""
        digest = None if self._embeds is None else embeds_digest(self._embeds, start, end)
        return block_extra_keys_033(
            start, end, lora=self._lora, mm_items=self._mm, cache_salt=self._cache_salt, embeds_digest=digest
        )


def embeds_digest(rows: Sequence[bytes], start: int, end: int) -> bytes:
    """vLLM 0.33's prompt-embeds key of the span ``[start, end)``: the sha256 of its
    rows' bytes (of none past the prompt)."""
    return hashlib.sha256(b"".join(rows[start:end])).digest()


def prompt_embeds_digests(
    rows: Sequence[bytes], block_size: int, num_hash_lookahead_tokens: int = 0
) -> tuple[bytes, ...]:
    """The prompt-embeds digest of each hash block starting inside the prompt (its
    span: the block and its look-ahead tokens), as a vllm-0.33 pool takes them
    (:class:`kvcoord.engine.extra_keys.ExtraKeySources`) to publish the blocks' keys."""
    return tuple(
        embeds_digest(rows, start, start + block_size + num_hash_lookahead_tokens)
        for start in range(0, len(rows), block_size)
    )


def block_hasher(
    profile: str,
    algo: str,
    block_size: int,
    none: bytes,
    *,
    lora_path: str | None = None,
    num_hash_lookahead_tokens: int = 0,
    **keys: Any,
) -> BlockHasher | BlockHasher033:
    """The incremental hasher of a request for a pool of ``profile`` (``keys``: the
    request's LoRA name, cache salt, multimodal items and prompt embeddings, as
    :class:`BlockHasher` takes them; ``lora_path`` is read by vllm-0.33 only).

    Raises:
        ValueError: an unknown profile, or 0.33-only inputs (lookahead) for vllm-0.16.
    """
    if profile == "vllm-0.33":
        return BlockHasher033(
            algo,
            block_size,
            none,
            lora_path=lora_path,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            **keys,
        )
    if profile != "vllm-0.16":
        raise ValueError(f"unknown profile {profile!r}; choose vllm-0.16 or vllm-0.33")
    if num_hash_lookahead_tokens:
        raise ValueError("lookahead block hashes exist only in the vllm-0.33 profile")
    return BlockHasher(algo, block_size, none, **keys)
