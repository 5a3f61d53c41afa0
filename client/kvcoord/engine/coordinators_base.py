"""The coordinator's base: one manager per group, per-request operations fanned out to
them in group order, and the coordinator of a pool that caches nothing. The searches
that differ by layout are :mod:`~kvcoord.engine.coordinators` (one group) and
:mod:`~kvcoord.engine.coordinators_hybrid` (several)."""

from __future__ import annotations

from collections.abc import Sequence

from .block_pool import BlockPool
from .blocks import KVCacheBlock
from .config import KVCacheConfig
from .managers import (
    CrossAttentionManager,
    MambaManager,
    MambaManager033,
    SingleTypeKVCacheManager,
    manager_class,
)
from .profiles import rules_of
from .request import Request
from .specs import FullAttentionSpec, event_spec_fields

BlockLists = list[list[KVCacheBlock]]
IdLists = list[list[int]]


class KVCacheCoordinator:
    """Owns the block pool and one manager per group, in group order.

    Every per-request operation visits the managers in group order, so new block ids
    are taken group 0 first and freed blocks reach the free queue group 0 first.
    """

    #: the coordinator's cache_blocks stops at the request's hashed tokens itself, after
    #: its own rounding; otherwise the caller clamps the count first
    caps_cache_at_hashes = False
    #: every manager caches its newly full blocks by the base rule (the pool's
    #: allocate_slots fast path may then cache them itself); False when this
    #: coordinator's cache_blocks has rules of its own
    plain_caching = True

    def __init__(self, config: KVCacheConfig, materialize_blocks: bool = False) -> None:
        self.config = config
        self.enable_caching = config.enable_caching
        rules = rules_of(config.profile)
        self.block_pool = BlockPool(
            config.num_blocks,
            config.enable_caching,
            config.hash_block_size,
            config.enable_kv_cache_events,
            num_groups=len(config.groups),
            materialize=materialize_blocks,
            prepend_unhashed_frees=rules.prepend_unhashed_frees,
            group_event_fields=[event_spec_fields(g) for g in config.groups] if rules.event_fields else None,
            num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
            multi_key_blocks=rules.event_fields
            and config.enable_caching
            and (
                config.partial_hash_hits
                or any(
                    isinstance(g, FullAttentionSpec) and g.block_size > config.hash_block_size
                    for g in config.groups
                )
            ),
        )
        partial = config.partial_hash_hits
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_class(spec, config.profile, partial)(spec, self.block_pool, gid, config.enable_caching)
            for gid, spec in enumerate(config.groups)
        ]
        for m in self.managers:
            if isinstance(m, MambaManager033):
                m.shared_prefix_checkpoint = config.mamba_shared_prefix_checkpoint
        self._is_cross = [isinstance(m, CrossAttentionManager) for m in self.managers]
        self._two_phase_external = rules.two_phase_external

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        token_caps: Sequence[int | None] | None = None,
        prefill_end: int = 0,
        record: bool = True,
    ) -> int:
        """Free blocks the allocation would consume over every group. ``token_caps``
        (vLLM 0.33's admission cap): per group, the most tokens counted (``None``: no cap);
        a capped count records nothing (vLLM 0.33's mamba prefill checkpoint is planned
        by the uncapped count), nor does one with ``record`` false. ``prefill_end``:
        where the request's prefill ends."""
        if self.config.prefix_cache_retention_interval != 0:
            prefill_end = 0  # dense retention: every chunk publishes a state (vLLM 0.33)
        total = 0
        for gid, manager in enumerate(self.managers):
            if self._is_cross[gid]:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, num_encoder_tokens
                )
            else:
                cap = token_caps[gid] if token_caps is not None else None
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens if cap is None or cap >= num_tokens else cap,
                    new_computed_blocks[gid],
                    total_computed_tokens,
                    num_tokens_main_model,
                    prefill_end=prefill_end,
                    record=record and token_caps is None,
                )
        return total

    def uncounted_external_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        prefill_end: int = 0,
    ) -> list[tuple[int, int]]:
        """A first allocation with external tokens: per mamba ``align`` group whose
        allocation would take more blocks than :meth:`get_num_blocks_to_allocate`
        counts, ``(group id, how many more)`` (see
        :meth:`~kvcoord.engine.managers.mamba.MambaManager.uncounted_external_blocks`).
        Changes nothing."""
        if self.config.prefix_cache_retention_interval != 0:
            prefill_end = 0  # as get_num_blocks_to_allocate
        out = []
        for gid, manager in enumerate(self.managers):
            if isinstance(manager, MambaManager):
                n = manager.uncounted_external_blocks(
                    request_id,
                    new_computed_blocks[gid],
                    total_computed_tokens,
                    num_tokens_main_model,
                    prefill_end,
                )
                if n:
                    out.append((gid, n))
        return out

    def external_blocks_taking_hits(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> list[tuple[int, int, int]]:
        """vLLM 0.16's group-by-group adoption (not ``two_phase_external``) of a first-use
        request's hit and external tokens, on block ids: each block an earlier group would
        take from the free queue for its external tokens that a later group's hit then
        touches, as ``(taking group, hit group, block id)`` (that block would be held twice:
        in both tables, its hash dropped). Changes nothing; empty outside vLLM 0.16's
        order, without external tokens, or without a free hit block past the first group.
        """
        if self._two_phase_external or num_external_computed_tokens <= 0 or len(self.managers) < 2:
            return []
        plans = [
            m.external_adoption_plan(
                request_id, new_computed_blocks[gid], num_local_computed_tokens, num_external_computed_tokens
            )
            for gid, m in enumerate(self.managers)
        ]
        hit_group = {bid: gid for gid, (touched, _) in enumerate(plans) for bid in touched}
        if all(gid == 0 for gid in hit_group.values()):
            return []
        # the queue's head as each group meets it: its own hit touched (taken out), then
        # its external blocks popped; a later group's free hit block popped here is the case
        queue = self.block_pool.free_block_queue.head_ids(sum(n for _, n in plans) + len(hit_group))
        gone: set[int] = set()
        pos = 0
        out = []
        for gid, (touched, n) in enumerate(plans):
            gone.update(touched)
            while n > 0 and pos < len(queue):
                bid = queue[pos]
                pos += 1
                if bid in gone:
                    continue
                n -= 1
                if hit_group.get(bid, -1) > gid:
                    out.append((gid, hit_group[bid], bid))
        return out

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """A first-use request adopts its prefix hit and gets blocks for its external
        (KV connector) tokens. vLLM 0.16 does both group by group, so an earlier
        group's external blocks may evict a later group's hit blocks before they are
        touched; vLLM 0.33 (``two_phase_external``) touches every group's hit first,
        then allocates every group's external blocks."""
        if not self._two_phase_external:
            for gid, manager in enumerate(self.managers):
                manager.allocate_new_computed_blocks(
                    request_id,
                    new_computed_blocks[gid],
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                )
            return
        if any(request_id in m.num_cached_block for m in self.managers):
            return  # admitted: no new hit
        for gid, manager in enumerate(self.managers):
            manager.add_local_computed_blocks(
                request_id, new_computed_blocks[gid], num_local_computed_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens > 0:
            for manager in self.managers:
                manager.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens
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

    def free_all_groups_reversed(self, request_id: str) -> None:
        """vLLM 0.33's deferred free (a KV-consumer connector with overlapping steps):
        every group's list is taken at once (``pop_blocks_for_free``), concatenated in
        group order, and released later in one reversed pass: the last group's tail
        reaches the free queue first, group 0's head last. Each manager forgets the
        request by its own rule (``pop_blocks_for_free``: a mamba group drops its
        per-request state). For managers whose ``free`` is the base one only (the pool
        checks)."""
        blocks: list[KVCacheBlock] = []
        for manager in self.managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_num_common_prefix_blocks(self, request_id: str, others: int = 0) -> list[int]:
        return [m.get_num_common_prefix_blocks(request_id, others) for m in self.managers]

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

    def get_num_common_prefix_blocks(self, request_id: str, others: int = 0) -> list[int]:
        return [0] * len(self.managers)
