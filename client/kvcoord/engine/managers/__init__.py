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
from .sliding_window import SlidingWindowManager

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "cdiv",
    "manager_class",
    "spec_manager_map",
]

spec_manager_map: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}


def manager_class(spec: AttentionSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class serving ``spec``."""
    return spec_manager_map[type(spec)]
