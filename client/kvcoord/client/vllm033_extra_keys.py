"""What a vLLM 0.33 request's blocks' extra keys derive from besides its LoRA and salt
(multimodal items, prompt-embeds digests), and the request tracker set to send them to a
``vllm-0.33`` pool (:func:`name_extra_keys_033`), so the pool publishes vLLM 0.33's
``BlockStored.extra_keys``."""

from __future__ import annotations

from typing import Any

from kvcoord.engine.extra_keys import ExtraKeySources, MultiModalItem
from kvcoord.v1 import allocator_pb2 as pb

from .hashing import prompt_embeds_digests
from .tracking import RequestTracker

__all__ = ["extra_key_sources_033", "name_extra_keys_033"]


def extra_key_sources_033(
    request: Any, hash_block_size: int, num_hash_lookahead_tokens: int
) -> ExtraKeySources | None:
    """What a vLLM 0.33 request's blocks' extra keys derive from besides its LoRA and
    salt (``None``: nothing): its multimodal items, and for a prompt given as
    embeddings the digest of each hash block's embedding bytes (vLLM's ``tensor_data``
    of each row, :func:`~kvcoord.client.hashing.prompt_embeds_digests`)."""
    features = getattr(request, "mm_features", None) or ()
    embeds = getattr(request, "prompt_embeds", None)
    if not features and embeds is None:
        return None
    items = tuple(
        MultiModalItem(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
        for f in features
    )
    digests = None
    if embeds is not None:
        from vllm.v1.utils import tensor_data

        rows = [bytes(tensor_data(row)) for row in embeds]
        # (no rows: no digests, as the wire reads an empty list)
        digests = prompt_embeds_digests(rows, hash_block_size, num_hash_lookahead_tokens) or None
    if not items and digests is None:
        return None
    return ExtraKeySources(items, digests)


def name_extra_keys_033(tracker: RequestTracker, config: pb.PoolConfig) -> None:
    """A vllm-0.33 pool names a request's cache salt, multimodal items and prompt-embeds
    digests in its BlockStored.extra_keys: the sync registering a request carries them
    (the items and digests only to a pool publishing events of cached blocks), and, to
    a pool publishing events, the ``full`` report mode (its hits are re-announced)."""
    tracker.name_salts = True
    tracker.report_modes = config.enable_kv_cache_events
    if config.enable_kv_cache_events and config.enable_caching:
        hash_block_size, lookahead = config.hash_block_size, config.num_hash_lookahead_tokens
        tracker.extra_keys_of = lambda request: extra_key_sources_033(request, hash_block_size, lookahead)
