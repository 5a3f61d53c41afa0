"""vLLM 0.33's extra keys of one block, the one place kvcoord states the rule.

A vllm-0.33 block's extra keys are, in this order: ``("lora", name, path)`` (every
block of a LoRA request), ``("mm", identifier, item offset - block start)`` for each
multimodal item overlapping the block's span, ``("cache_salt", salt)`` (the block
starting at token 0), ``("prompt_embeds", sha256 of the span's embedding bytes)`` (a
request given as embeddings: every block, a block past the prompt hashing no bytes).
With ``num_hash_lookahead_tokens`` L the span is the block and the L tokens after it.
:class:`kvcoord.client.hashing.BlockHasher033` hashes these keys (tagged); a pool
publishes them untagged in BlockStored.extra_keys (:func:`event_extra_keys`), as vLLM
0.33 does, from the :class:`ExtraKeySources` the client registered with the request.

Stdlib only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "EMPTY_EMBEDS_DIGEST",
    "ExtraKeySources",
    "MultiModalItem",
    "block_extra_keys_033",
    "event_extra_keys",
]

#: the prompt-embeds digest of a span past the prompt: sha256 of no bytes
EMPTY_EMBEDS_DIGEST = bytes.fromhex("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")


@dataclasses.dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input: its identifier and the token span it occupies."""

    identifier: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class ExtraKeySources:
    """What a vllm-0.33 request's blocks' extra keys derive from besides its LoRA
    and cache salt (for KV events).

    ``mm_items``: the request's multimodal items, sorted by offset, not overlapping.
    ``embeds_digests``: for a prompt given as embeddings, the digest of each hash
    block's span (``[i * hash_block_size, (i + 1) * hash_block_size + L)``, cut at the
    prompt's end) for every block starting inside the prompt; ``None`` otherwise.
    """

    mm_items: tuple[MultiModalItem, ...] = ()
    embeds_digests: tuple[bytes, ...] | None = None


def mm_keys_033(items: Sequence[MultiModalItem], start: int, end: int) -> list[tuple[str, str, int]]:
    """``("mm", identifier, offset - start)`` of each item overlapping ``[start, end)``
    (``items`` sorted by offset, not overlapping)."""
    keys: list[tuple[str, str, int]] = []
    for item in items:
        if item.offset >= end:
            break
        if item.offset + item.length > start:
            keys.append(("mm", item.identifier, item.offset - start))
    return keys


def block_extra_keys_033(
    start: int,
    end: int,
    *,
    lora: tuple[object, ...] | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    cache_salt: str | None = None,
    embeds_digest: bytes | None = None,
) -> tuple[object, ...] | None:
    """vLLM 0.33's tagged extra keys of the span ``[start, end)`` (``None`` when none):
    ``lora`` is ``("lora", name, path)``; ``embeds_digest`` the span's prompt-embeds
    digest (``None``: the request has no prompt embeddings)."""
    keys: list[object] = []
    if lora is not None:
        keys.append(lora)
    if mm_items:
        keys.extend(mm_keys_033(mm_items, start, end))
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    if embeds_digest is not None:
        keys.append(("prompt_embeds", embeds_digest))
    return tuple(keys) if keys else None


def event_extra_keys(keys: tuple[object, ...] | None) -> tuple[object, ...] | None:
    """The untagged form vLLM 0.33 publishes in KV events: a LoRA's name, a cache
    salt, a prompt-embeds digest bare, a multimodal key as ``(identifier, offset)``."""
    if keys is None:
        return None
    out: list[object] = []
    for key in keys:
        assert isinstance(key, tuple)
        out.append(key[1:] if key[0] == "mm" else key[1])
    return tuple(out)
