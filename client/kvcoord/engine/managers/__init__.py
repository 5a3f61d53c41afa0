"""One manager class per attention type, chosen through :data:`spec_manager_map`."""

from __future__ import annotations

from ..specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from .base import SingleTypeKVCacheManager, cdiv
from .chunked_local import ChunkedLocalAttentionManager
from .cross_attention import CrossAttentionManager
from .full_attention import FullAttentionManager
from .mamba import MambaManager
from .mamba033 import MambaManager033
from .partial import PartialFullAttentionManager, PartialMambaManager
from .sliding_window import SlidingWindowManager

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "MambaManager033",
    "PartialFullAttentionManager",
    "PartialMambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "cdiv",
    "manager_class",
    "spec_manager_map",
    "spec_manager_map_033",
    "spec_manager_map_partial",
]

spec_manager_map: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}


#: the vllm-0.33 profile's own manager classes, where a type's rules changed
spec_manager_map_033: dict[type, type[SingleTypeKVCacheManager]] = {
    MambaSpec: MambaManager033,
}


#: the managers of a vllm-0.33 pool with fine-grained (partial) hits
spec_manager_map_partial: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: PartialFullAttentionManager,
    MambaSpec: PartialMambaManager,
}


def manager_class(
    spec: AttentionSpec, profile: str = "vllm-0.16", partial_hash_hits: bool = False
) -> type[SingleTypeKVCacheManager]:
    """The manager class serving ``spec`` in a pool of ``profile`` (``partial_hash_hits``:
    a vllm-0.33 pool with fine-grained hits, see
    :attr:`~kvcoord.engine.config.KVCacheConfig.partial_hash_hits`)."""
    if partial_hash_hits:
        return spec_manager_map_partial[type(spec)]
    if profile == "vllm-0.33":
        cls = spec_manager_map_033.get(type(spec))
        if cls is not None:
            return cls
    return spec_manager_map[type(spec)]
