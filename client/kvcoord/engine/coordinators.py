"""KV cache coordinators: fan per-request operations out to one manager per group,
and find the longest prefix hit every group agrees on."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .block_pool import BlockPool
from .blocks import KVCacheBlock
from .config import KVCacheConfig, attention_groups
from .hash_list import hashes_at_block_size
from .managers import CrossAttentionManager, SingleTypeKVCacheManager, manager_class
from .request import Request
from .specs import AttentionSpec, FullAttentionSpec

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
]

BlockLists = list[list[KVCacheBlock]]
IdLists = list[list[int]]


class KVCacheCoordinator:
    """Owns the block pool and one manager per group, in group order.

    Every per-request operation visits the managers in group order, so new block ids
    are taken group 0 first and freed blocks reach the free queue group 0 first.
    """

    def __init__(self, config: KVCacheConfig, materialize_blocks: bool = False) -> None:
        self.config = config
        self.enable_caching = config.enable_caching
        self.block_pool = BlockPool(
            config.num_blocks,
            config.enable_caching,
            config.hash_block_size,
            config.enable_kv_cache_events,
            num_groups=len(config.groups),
            materialize=materialize_blocks,
        )
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_class(spec)(spec, self.block_pool, gid, config.enable_caching)
            for gid, spec in enumerate(config.groups)
        ]
        self._is_cross = [isinstance(m, CrossAttentionManager) for m in self.managers]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        total = 0
        for gid, manager in enumerate(self.managers):
            if self._is_cross[gid]:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, num_encoder_tokens
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[gid],
                    total_computed_tokens,
                    num_tokens_main_model,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        for gid, manager in enumerate(self.managers):
            manager.allocate_new_computed_blocks(
                request_id,
                new_computed_blocks[gid],
                num_local_computed_tokens,
                num_external_computed_tokens,
            )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> BlockLists:
        return [
            manager.allocate_new_blocks(
                request_id,
                num_encoder_tokens if self._is_cross[gid] else num_tokens,
                num_tokens_main_model,
            )
            for gid, manager in enumerate(self.managers)
        ]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return [m.get_num_common_prefix_blocks(request_id) for m in self.managers]

    def get_blocks(self, request_id: str) -> BlockLists:
        return [m.req_to_blocks.get(request_id) or [] for m in self.managers]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[IdLists, int]:
        """One block-id list per group (0 = null block) and the hit length in tokens.

        ``max_cache_hit_length`` must be >= 0."""
        raise NotImplementedError

    @property
    def alignment_tokens(self) -> int:
        """Every hit length is a multiple of this."""
        return 1


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: lookups find nothing, nothing is ever cached."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[IdLists, int]:
        return [[] for _ in self.managers], 0

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return [0] * len(self.managers)


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


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several distinct specs: a fixed-point search over attention groups.

    Full attention is searched first; each other type can only shorten the hit, and
    passes repeat until the length stops shrinking, except in the *simple* case (two
    attention groups, the first full attention), which stops after one pass. Every
    accepted length is a multiple of the LCM of the block sizes.
    """

    def __init__(self, config: KVCacheConfig, materialize_blocks: bool = False) -> None:
        super().__init__(config, materialize_blocks)
        self.attention_groups: list[tuple[AttentionSpec, list[int], type[SingleTypeKVCacheManager]]] = [
            (spec, ids, type(self.managers[ids[0]])) for spec, ids in attention_groups(config.groups)
        ]
        self.lcm_block_size = math.lcm(*(spec.block_size for spec, _, _ in self.attention_groups))
        self._first_is_full = isinstance(self.attention_groups[0][0], FullAttentionSpec)
        self.is_simple_hybrid = len(self.attention_groups) == 2 and self._first_is_full

    @property
    def alignment_tokens(self) -> int:
        return self.lcm_block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[IdLists, int]:
        hash_block_size = self.config.hash_block_size
        use_eagle = self.config.use_eagle
        lcm = self.lcm_block_size
        views = {
            spec.block_size: hashes_at_block_size(block_hashes, hash_block_size, spec.block_size)
            for spec, _, _ in self.attention_groups
        }
        result: list[list[int] | None] = [None] * len(self.managers)
        hit = max_cache_hit_length
        while True:
            cur = hit
            for spec, ids, cls in self.attention_groups:
                if isinstance(spec, FullAttentionSpec) and result[ids[0]] is not None:
                    cur = (cur // spec.block_size) * spec.block_size
                    continue
                lists = cls.find_longest_cache_hit(
                    views[spec.block_size], cur, ids, self.block_pool, spec, use_eagle, lcm
                )
                cur = len(lists[0]) * spec.block_size
                for gid, lst in zip(ids, lists, strict=False):
                    result[gid] = lst
            if cur >= hit:
                break
            hit = cur
            if self.is_simple_hybrid:
                break
        if self._first_is_full:
            spec, ids, _ = self.attention_groups[0]
            n = hit // spec.block_size
            for gid in ids:
                kept = result[gid]
                assert kept is not None
                del kept[n:]
        return [lst if lst is not None else [] for lst in result], hit

    def hit_length_from_run(self, block_hashes: Sequence[bytes], max_cache_hit_length: int, run: int) -> int:
        """:meth:`find_longest_cache_hit`'s length alone, for a pool whose first
        attention group is one full-attention group, given ``run``: how many keys of
        that group's view are cached from the first on, counted at least up to
        ``min(max_cache_hit_length // block_size, len(view))`` (a cross-pool index's
        walk). That group's search is this run, capped, EAGLE's drop and the alignment
        applied as its manager does; every other group is searched as in the full
        search (their block ids are made and dropped)."""
        first_spec, first_ids, _ = self.attention_groups[0]
        assert self._first_is_full and len(first_ids) == 1, "only for one full-attention group first"
        hash_block_size = self.config.hash_block_size
        use_eagle = self.config.use_eagle
        lcm = self.lcm_block_size
        views = {
            spec.block_size: hashes_at_block_size(block_hashes, hash_block_size, spec.block_size)
            for spec, _, _ in self.attention_groups[1:]
        }
        bs = first_spec.block_size
        n = min(run, max_cache_hit_length // bs)
        if use_eagle and n:
            n -= 1
        while (n * bs) % lcm:
            n -= 1
        hit = max_cache_hit_length
        cur = n * bs
        first = True
        while True:
            if not first:
                cur = (hit // bs) * bs
            first = False
            for spec, ids, cls in self.attention_groups[1:]:
                lists = cls.find_longest_cache_hit(
                    views[spec.block_size], cur, ids, self.block_pool, spec, use_eagle, lcm
                )
                cur = len(lists[0]) * spec.block_size
            if cur >= hit:
                break
            hit = cur
            if self.is_simple_hybrid:
                break
        return hit


def get_kv_cache_coordinator(config: KVCacheConfig, materialize_blocks: bool = False) -> KVCacheCoordinator:
    """vLLM's factory rule: no caching, one group, or several groups.

    Args:
        config: the pool layout.
        materialize_blocks: create every block object up front instead of on first use
            (same answers; a reference for tests).
    """
    kind = config.coordinator_kind
    return _COORDINATORS[kind](config, materialize_blocks)


_COORDINATORS: dict[str, type[KVCacheCoordinator]] = {
    "no_prefix_cache": KVCacheCoordinatorNoPrefixCache,
    "unitary": UnitaryKVCacheCoordinator,
    "hybrid": HybridKVCacheCoordinator,
}
