"""The pool seen from outside: statistics, events, block tables, free counts, the
replica state and snapshots. Nothing here takes or frees a block.
"""

from __future__ import annotations

from collections.abc import Callable

from .coordinators_base import KVCacheCoordinator
from .events import KVCacheEvent
from .managers import MambaManager, MambaManager033
from .managers.partial import CopyOnWrite, PartialMambaManager
from .pool_requests import PoolRequests
from .results import BlockIds, PoolSnapshot
from .specs import FullAttentionSpec
from .stats import LookupCounters, PrefixCacheStats


class PoolInspection(PoolRequests):
    """:class:`~kvcoord.engine.pool.KVCachePool`'s reading calls."""

    def take_events(self) -> list[KVCacheEvent]:
        """KV events queued since the last call, oldest first."""
        return self.block_pool.take_events()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics lookups record into now (``None`` unless the config logs
        stats). Settable: the service swaps in a session's own object for a step."""
        return self.hits.prefix_cache_stats

    @prefix_cache_stats.setter
    def prefix_cache_stats(self, stats: PrefixCacheStats | None) -> None:
        self.hits.prefix_cache_stats = stats

    @property
    def lookup_counters(self) -> LookupCounters:
        """Lifetime lookup counters (never reset)."""
        return self.hits.lookup_counters

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics since the last call; counting starts again from zero."""
        hits = self.hits
        if hits.prefix_cache_stats is None:
            return None
        stats, hits.prefix_cache_stats = hits.prefix_cache_stats, PrefixCacheStats()
        return stats

    def peek_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """A copy of the current statistics, without resetting them."""
        return None if self.prefix_cache_stats is None else self.prefix_cache_stats.copy()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any request holds a block."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's block table per group (null blocks included)."""
        self._get(request_id)
        return tuple(tuple(b.block_id for b in lst) for lst in self.coordinator.get_blocks(request_id))

    def get_num_common_prefix_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group, the leading blocks of this request shared by every holder: every
        request, and every router's reservation, counted as a request holding its
        blocks (vLLM's count of requests alone would call a block of this request and
        a reservation common to a request that lacks it)."""
        self._get(request_id)
        if self.rules.common_prefix_zeros:
            return (0,) * len(self.managers)
        return tuple(self.coordinator.get_num_common_prefix_blocks(request_id, len(self.reservations.live)))

    def lone_common_prefix(self) -> Callable[[str], int] | None:
        """In a pool of one group whose coordinator reads its manager's count, that
        manager's ``get_num_common_prefix_blocks``: :meth:`get_num_common_prefix_blocks`'s
        one value for a request the pool holds (unchecked), in one call, for a caller
        reading it every scheduler step, while the pool holds no reservation (a mirror:
        an exclusive session's pool is refused them); ``None`` for any other pool."""
        if (
            self.rules.common_prefix_zeros
            or len(self.managers) != 1
            or type(self.coordinator).get_num_common_prefix_blocks
            is not KVCacheCoordinator.get_num_common_prefix_blocks
        ):
            return None
        return self.managers[0].get_num_common_prefix_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def free_and_usage(self) -> tuple[int, float]:
        """:attr:`num_free_blocks` and :attr:`usage` in one read (a router's score)."""
        return self.block_pool.free_and_usage()

    def cached_block_ids(self) -> list[int]:
        """Ids of the blocks that currently hold a prefix-cache hash, ascending."""
        return self.block_pool.cached_block_ids()

    def free_queue_head(self, limit: int | None = None) -> list[int]:
        """Free block ids from the next to be reused, at most ``limit``."""
        return self.block_pool.free_block_queue.head_ids(limit)

    def replica_state(self) -> tuple[int, list[int], list[tuple[bytes, int]]] | str:
        """What a client replica of this pool starts from: the first never-used block,
        the used free blocks (head first) and the prefix-cache map as ``(hash, block)``
        pairs in its order (keys in insertion order, then each key's blocks); or, when
        a replica cannot be exact, why.

        A replica is exact for a pool of one full-attention group (no sink) whose block
        size is the hash block size, that holds no request and caches under no
        namespace: every cached block's key is then its hash.
        """
        specs = self.config.groups
        spec = specs[0] if len(specs) == 1 else None
        if not isinstance(spec, FullAttentionSpec) or spec.sink_len:
            return "the pool is not one group of full attention without a sink"
        if spec.block_size != self.config.hash_block_size:
            return "the pool's block size is not its hash block size"
        if self.config.use_eagle:
            return "the pool uses EAGLE drafts (a hit drops its last block)"
        if self.config.profile != "vllm-0.16":
            return f"the pool's profile is {self.config.profile} (replicas follow vllm-0.16 only)"
        if self.requests:
            return "the pool holds requests"
        if self.reservations.live:
            return "the pool holds reservations"
        if self.cache_namespaces:
            return "the pool caches under tenants' namespaces"
        queue = self.block_pool.free_block_queue
        fresh = queue.next_fresh
        used = queue.head_ids()[self.config.num_blocks - fresh :]
        cache = self.block_pool.cached_block_hash_to_block
        first, more = cache.first[0], cache.more[0]
        pairs: list[tuple[bytes, int]] = []
        for block_hash, block_id in first.items():
            later = more.get(block_hash)
            pairs.extend((block_hash, b) for b in (later if later is not None else (block_id,)))
        return fresh, used, pairs

    def snapshot(self) -> PoolSnapshot:
        """A complete, comparable copy of the pool's observable state."""
        bp = self.block_pool
        managers = []
        for m in self.managers:
            extra: tuple[object, ...] = ()
            if isinstance(m, MambaManager):
                extra = (sorted(m.allocated_block_reqs), sorted(m.last_state_block_idx.items()))
            if isinstance(m, MambaManager033):
                extra += (
                    sorted(m.num_retired_blocks.items()),
                    sorted(m.cached_this_step),
                    tuple((r, g, b.block_id, t) for r, g, b, t in m.pending_offloads),
                    tuple(sorted(m.checkpoints.items())),
                )
            if isinstance(m, CopyOnWrite):
                extra += (
                    tuple(sorted((r, i, b.block_id) for r, (i, b) in m.partial_hit_reqs.items())),
                    tuple((a.block_id, b.block_id) for a, b in m.pending_cow),
                )
            if isinstance(m, PartialMambaManager):
                extra += (tuple(sorted((r, b.block_id, t) for r, (b, t) in m.producer_tails.items())),)
            if self._zeroed_groups:
                extra += (tuple(self.pending_new_block_ids[m.group_id]),)
            managers.append(
                (
                    tuple((r, tuple(b.block_id for b in bl)) for r, bl in sorted(m.req_to_blocks.items())),
                    tuple(sorted(m.num_cached_block.items())),
                    extra,
                )
            )
        return PoolSnapshot(
            free_queue=tuple(bp.free_block_queue.head_ids()),
            ref_cnts=bp.ref_cnts(),
            block_hashes=bp.block_hashes(),
            hash_map=tuple((k, tuple(v)) for k, v in bp.cached_block_hash_to_block.items()),
            requests=self.request_table.snapshot(),
            managers=tuple(managers) + ((tuple(sorted(self.retained.items())),) if self.cow_managers else ()),
            pending_events=tuple(bp.kv_event_queue),
            stats=self.peek_prefix_cache_stats(),
        )
