"""KV cache coordinators: fan per-request operations out to one manager per group,
and find the longest prefix hit every group agrees on.

The base and the no-caching coordinator are :mod:`~kvcoord.engine.coordinators_base`;
the one-group (unitary) coordinators and the factory are here; the hybrid ones are
:mod:`~kvcoord.engine.coordinators_hybrid`; sliding-window retention is
:mod:`~kvcoord.engine.retention`."""

from __future__ import annotations

from collections.abc import Sequence

from .config import KVCacheConfig
from .coordinators_base import BlockLists, IdLists, KVCacheCoordinator, KVCacheCoordinatorNoPrefixCache
from .coordinators_hybrid import HybridKVCacheCoordinator, HybridKVCacheCoordinator033
from .request import Request
from .retention import replay_boundaries, window_block_mask
from .specs import SlidingWindowSpec

__all__ = [
    "BlockLists",
    "HybridKVCacheCoordinator",
    "HybridKVCacheCoordinator033",
    "IdLists",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator",
    "UnitaryKVCacheCoordinator033",
    "get_kv_cache_coordinator",
    "replay_boundaries",
    "window_block_mask",
]


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group, caching on: the group's own search, aligned to its block size."""

    def __init__(self, config: KVCacheConfig, materialize_blocks: bool = False) -> None:
        super().__init__(config, materialize_blocks)
        self.spec = config.groups[0]
        self.block_size = self.spec.block_size
        self._search = type(self.managers[0]).find_longest_cache_hit

    @property
    def alignment_tokens(self) -> int:
        return self.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[IdLists, int]:
        hit = self._search(
            block_hashes,
            max_cache_hit_length,
            (0,),
            self.block_pool,
            self.spec,
            self.config.use_eagle,
            self.block_size,
        )
        return hit, len(hit[0]) * self.block_size


class UnitaryKVCacheCoordinator033(UnitaryKVCacheCoordinator):
    """vLLM 0.33's coordinator of one group (profile vllm-0.33): a sliding-window group
    hashes only the blocks its retention keeps (:func:`window_block_mask`; the replay
    boundaries are the prompt's, :func:`replay_boundaries`, as one group has no
    shared-prefix junction); every other type caches as under 0.16. With EAGLE's drop
    (``use_eagle``, the group flagged or none) the search drops the last matched block
    as 0.16's does."""

    def __init__(self, config: KVCacheConfig, materialize_blocks: bool = False) -> None:
        super().__init__(config, materialize_blocks)
        self.plain_caching = not isinstance(self.spec, SlidingWindowSpec)
        self.eagle = config.eagle_drops((0,))

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[IdLists, int]:
        hit = self._search(
            block_hashes, max_cache_hit_length, (0,), self.block_pool, self.spec, self.eagle, self.block_size
        )
        return hit, len(hit[0]) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        m = self.managers[0]
        spec = self.spec
        if not isinstance(spec, SlidingWindowSpec):
            m.cache_blocks(request, num_computed_tokens)
            return
        rid = request.request_id
        bs = self.block_size
        num_cached = m.num_cached_block.get(rid, 0)
        num_full = num_computed_tokens // bs
        if num_cached >= num_full:
            return
        mask = window_block_mask(
            spec.sliding_window,
            bs,
            bs,
            self.config.prefix_cache_retention_interval,
            num_cached,
            num_full,
            replay_boundaries(request.num_prompt_tokens, bs, self.eagle),
            self.eagle,
        )
        blocks = m.req_to_blocks.setdefault(rid, [])
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full, bs, m.group_id, mask)
        m.num_cached_block[rid] = num_full


def get_kv_cache_coordinator(config: KVCacheConfig, materialize_blocks: bool = False) -> KVCacheCoordinator:
    """vLLM's factory rule: no caching, one group, or several groups.

    Args:
        config: the pool layout.
        materialize_blocks: create every block object up front instead of on first use
            (same answers; a reference for tests).
    """
    kind = config.coordinator_kind
    if config.profile == "vllm-0.33":
        if kind == "hybrid":
            return HybridKVCacheCoordinator033(config, materialize_blocks)
        if kind == "unitary":
            return UnitaryKVCacheCoordinator033(config, materialize_blocks)
    return _COORDINATORS[kind](config, materialize_blocks)


_COORDINATORS: dict[str, type[KVCacheCoordinator]] = {
    "no_prefix_cache": KVCacheCoordinatorNoPrefixCache,
    "unitary": UnitaryKVCacheCoordinator,
    "hybrid": HybridKVCacheCoordinator,
}
