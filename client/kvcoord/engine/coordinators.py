"""KV cache coordinators: fan per-request operations out to one manager per group,
and find the longest prefix hit every group agrees on."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .block_pool import BlockPool
from .blocks import KVCacheBlock
from .config import KVCacheConfig, attention_groups
from .hash_list import hashes_at_block_size
from .managers import CrossAttentionManager, MambaManager033, SingleTypeKVCacheManager, manager_class
from .managers.partial import find_partial_full_hit, find_partial_mamba_hit
from .profiles import rules_of
from .request import Request
from .specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec, event_spec_fields

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
    ) -> int:
        """Free blocks the allocation would consume over every group. ``token_caps``
        (vLLM 0.33's admission cap): per group, the most tokens counted (``None``: no cap);
        a capped count records nothing (vLLM 0.33's mamba prefill checkpoint is planned
        by the uncapped count). ``prefill_end``: where the request's prefill ends."""
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
                    record=token_caps is None,
                )
        return total

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

    def _views(self, block_hashes: Sequence[bytes]) -> dict[int, Sequence[bytes]]:
        """The request's hashes at each attention group's block size."""
        size = self.config.hash_block_size
        return {
            spec.block_size: hashes_at_block_size(block_hashes, size, spec.block_size)
            for spec, _, _ in self.attention_groups
        }

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[IdLists, int]:
        use_eagle = self.config.use_eagle
        lcm = self.lcm_block_size
        views = self._views(block_hashes)
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


class HybridKVCacheCoordinator033(HybridKVCacheCoordinator):
    """vLLM 0.33's hybrid coordinator (profile vllm-0.33).

    The search is 0.16's fixed point, except that every full-attention group is cut
    back to the final length (0.16 cut back only the first), and it also reports the
    longest length any group found (``last_longest_hit``): where that exceeds the
    final hit, a sparse group lags behind a shared prefix, and the request keeps that
    junction (its ``shared_prefix_boundary``) hittable when it caches.

    Caching rounds every group down to the scheduler block size (the LCM) and, under
    sparse retention (``prefix_cache_retention_interval`` 0), hashes only the
    sliding-window blocks a later lookup can reach: the ``cdiv(w - 1, block)`` blocks
    ending at the prompt's replay boundary (``num_prompt_tokens - 1``) or at the
    request's shared-prefix junction, each rounded down to the scheduler block (dense
    and periodic retention: :func:`window_block_mask`). Mamba
    groups cache by their own rules (:class:`~kvcoord.engine.managers.MambaManager033`),
    given the same rounded length. With look-ahead hashes the count is rounded down
    first and then stopped at the hashed tokens, as vLLM 0.33's managers do (so a prompt
    of 64 tokens with 16-token hash blocks, one look-ahead token and a 32-token
    scheduler block caches 48 tokens of a 16-token group, not 32): the caller passes
    the unclamped count.

    EAGLE's trailing-block drop (``use_eagle``: the attention groups holding a group of
    ``eagle_group_ids``, all when none is flagged) is 0.33's per group: such a group
    searches one block past the candidate length (clipped at the request's hashed
    tokens), drops its last matched block and realigns, at most once per candidate
    length (a shorter candidate from another group makes it search again); it caches one
    block past the scheduler-block boundary (a later search's peek); and its sliding
    window keeps one more block, shifted one block up, at each replay boundary (with
    the drop on: one block below the prompt's last and its resend's aligned ends) and
    one block below a shared-prefix junction too.
    """

    caps_cache_at_hashes = True
    plain_caching = False  # round-down, sparse masks

    def __init__(self, config: KVCacheConfig, materialize_blocks: bool = False) -> None:
        super().__init__(config, materialize_blocks)
        self.scheduler_block_size = config.scheduler_block_size or self.lcm_block_size
        #: prefix_cache_retention_interval: 0 sparse, None dense, positive periodic
        self.retention = config.prefix_cache_retention_interval
        self.sparse = self.retention == 0
        #: fine-grained (partial) hits: hits and caching on hash-block boundaries
        self.partial_hash_hits = config.partial_hash_hits
        #: the longest length any group reached in the last search
        self.last_longest_hit = 0
        #: per attention group: its hits drop EAGLE's last block
        self.eagle = [config.eagle_drops(ids) for _, ids, _ in self.attention_groups]
        #: per group: it caches as an EAGLE group (its attention group drops)
        self.eagle_group = [False] * len(config.groups)
        for (_, ids, _), drops in zip(self.attention_groups, self.eagle, strict=True):
            for gid in ids:
                self.eagle_group[gid] = drops
        for m in self.managers:
            if isinstance(m, MambaManager033):  # mamba keeps its own caching rules
                m.alignment = config.hash_block_size if self.partial_hash_hits else self.scheduler_block_size
                m.sparse = self.sparse

    def hit_length_from_run(self, block_hashes: Sequence[bytes], max_cache_hit_length: int, run: int) -> int:
        if not self.partial_hash_hits and not any(self.eagle):
            return super().hit_length_from_run(block_hashes, max_cache_hit_length, run)
        longest = self.last_longest_hit  # the full search, which leaves the junction as it was
        hit = self.find_longest_cache_hit(block_hashes, max_cache_hit_length)[1]
        self.last_longest_hit = longest
        return hit

    def _search_group(
        self,
        spec: AttentionSpec,
        ids: list[int],
        cls: type[SingleTypeKVCacheManager],
        block_hashes: Sequence[bytes],
        views: dict[int, Sequence[bytes]],
        cur: int,
        drop: bool = False,
    ) -> tuple[IdLists, int]:
        """One attention group's search of at most ``cur`` tokens: its block ids per group
        and its length. With fine-grained hits the length is any hash-block multiple
        (:mod:`~kvcoord.engine.managers.partial`), else whole blocks at the scheduler
        block's alignment."""
        if not self.partial_hash_hits:
            lists = cls.find_longest_cache_hit(
                views[spec.block_size], cur, ids, self.block_pool, spec, drop, self.scheduler_block_size
            )
            return lists, len(lists[0]) * spec.block_size
        find = find_partial_full_hit if isinstance(spec, FullAttentionSpec) else find_partial_mamba_hit
        return find(block_hashes, views[spec.block_size], cur, ids, self.block_pool, spec.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[IdLists, int]:
        views = self._views(block_hashes)
        result: list[list[int] | None] = [None] * len(self.managers)
        group_hit = [0] * len(self.managers)
        longest = 0
        hit = max_cache_hit_length
        hashed = len(block_hashes) * self.config.hash_block_size
        verified: set[int] = set()  # EAGLE groups whose drop holds at the current length
        while True:
            cur = hit
            for idx, (spec, ids, cls) in enumerate(self.attention_groups):
                if isinstance(spec, FullAttentionSpec) and result[ids[0]] is not None:
                    cur = min(cur, group_hit[ids[0]])
                    continue
                drop = self.eagle[idx] and idx not in verified
                # EAGLE peeks one block past the candidate, then drops back
                limit = min(cur + spec.block_size, hashed) if drop else cur
                lists, found = self._search_group(spec, ids, cls, block_hashes, views, limit, drop)
                if drop:
                    verified.add(idx)
                elif found < cur:
                    verified.clear()
                cur = found
                for gid, lst in zip(ids, lists, strict=False):
                    result[gid] = lst
                    group_hit[gid] = cur
                longest = max(longest, cur)
            if cur >= hit:
                break
            hit = cur
            if self.is_simple_hybrid:
                break
        for spec, ids, _ in self.attention_groups:
            if isinstance(spec, FullAttentionSpec):
                n = -(-hit // spec.block_size)
                for gid in ids:
                    kept = result[gid]
                    if kept is not None:
                        del kept[n:]
        self.last_longest_hit = longest
        return [lst if lst is not None else [] for lst in result], hit

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        # fine-grained hits: no rounding (even to the hash block, which would
        # register a copied mamba tail again)
        align = 1 if self.partial_hash_hits else self.scheduler_block_size
        num_tokens = raw = num_computed_tokens // align * align
        hashed = len(request.block_hashes) * self.config.hash_block_size
        if hashed < num_tokens:
            num_tokens = hashed
        eagle = any(self.eagle)
        boundaries = list(replay_boundaries(request.num_prompt_tokens, self.scheduler_block_size, eagle))
        junction = request.shared_prefix_boundary
        bp = self.block_pool
        rid = request.request_id
        hbs = self.config.hash_block_size
        for m in self.managers:
            if isinstance(m, CrossAttentionManager):
                continue
            if isinstance(m, MambaManager033):
                # with fine-grained hits the prompt-boundary rule reads the count as it
                # comes (a step past the boundary does not key it again); the manager
                # stops its whole blocks at the hashed tokens itself
                m.cache_blocks(request, raw if self.partial_hash_hits else num_tokens)
                continue
            bs = m.block_size
            group_tokens = num_tokens
            ends = boundaries + [junction] if junction else boundaries
            if self.eagle_group[m.group_id]:
                if raw:  # the peek block past the boundary
                    group_tokens = min(num_computed_tokens, raw + bs, hashed)
                if junction:  # a sibling diverging right past it cannot peek
                    ends = ends + [junction - bs]
            num_cached = m.num_cached_block.get(rid, 0)
            num_full = group_tokens // bs
            if num_cached < num_full:
                self._cache_group(request, m, num_cached, num_full, ends)
            if bp.multi_key_blocks and isinstance(m.spec, FullAttentionSpec) and bs != hbs:
                self._cache_partial_tail(request, m, group_tokens)

    def _cache_group(
        self,
        request: Request,
        m: SingleTypeKVCacheManager,
        num_cached: int,
        num_full: int,
        boundaries: list[int],
    ) -> None:
        """Cache blocks ``num_cached .. num_full-1`` of one group (a sliding window's
        by its retention, :func:`window_block_mask`), after dropping the partial
        entries those blocks held."""
        bp = self.block_pool
        rid = request.request_id
        bs = m.block_size
        blocks = m.req_to_blocks.setdefault(rid, [])
        spec = m.spec
        if bp.multi_key_blocks:
            for i in range(num_cached, num_full):  # a partial entry gives way to the full block
                if blocks[i].cached_hash is not None:
                    bp.evict_all_keys(blocks[i])
        mask = None
        if isinstance(spec, SlidingWindowSpec):
            mask = window_block_mask(
                spec.sliding_window,
                bs,
                self.scheduler_block_size,
                self.retention,
                num_cached,
                num_full,
                boundaries,
                self.eagle_group[m.group_id],
            )
        bp.cache_full_blocks(request, blocks, num_cached, num_full, bs, m.group_id, mask)
        m.num_cached_block[rid] = num_full

    def _cache_partial_tail(self, request: Request, m: SingleTypeKVCacheManager, num_tokens: int) -> None:
        """vLLM 0.33: a full-attention group whose block is larger than the hash block
        also makes the prompt's last hash boundary below ``num_prompt_tokens`` reachable
        when it ends inside a block (a partial entry on that block; an EAGLE group's
        search reads the whole prompt before it drops, so there the limit is
        ``num_prompt_tokens``)."""
        hbs = self.config.hash_block_size
        limit = request.num_prompt_tokens - (0 if self.eagle_group[m.group_id] else 1)
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % m.block_size == 0:
            return
        blocks = m.req_to_blocks.get(request.request_id, ())
        index = boundary // m.block_size
        if index < len(blocks):
            self.block_pool.cache_partial_block(request, blocks[index], boundary, m.group_id)


def window_block_mask(
    window: int,
    block_size: int,
    scheduler_block_size: int,
    retention: int | None,
    num_cached: int,
    num_full: int,
    boundaries: Sequence[int],
    eagle: bool = False,
) -> list[bool] | None:
    """vLLM 0.33's sliding-window caching: which of blocks ``num_cached .. num_full-1``
    get a hash (``None``: all). A hit needs ``need = cdiv(w - 1, block)`` blocks; they
    are kept ending at the end of every segment (a scheduler block under dense
    retention, ``retention`` tokens under a positive interval, no segment under sparse
    retention, 0) and, unless dense (``None``), ending at each reachable ``boundaries``
    position rounded down to the scheduler block. Where ``need`` covers a whole
    segment every block is kept. With EAGLE's drop (``eagle``) a hit needs one block
    more, the block past each end (the one its search peeks at and drops)."""
    shift = 1 if eagle else 0
    need = -(-(window - 1) // block_size) + shift
    segment = scheduler_block_size if retention is None else retention
    mask = [False] * (num_full - num_cached)
    if segment:
        per_segment = segment // block_size
        if need >= per_segment:
            return None
        for i in range(max(num_cached, shift), num_full):
            if (i - shift) % per_segment >= per_segment - need:
                mask[i - num_cached] = True
    if retention is not None:
        for boundary in boundaries:
            end = boundary // scheduler_block_size * scheduler_block_size // block_size + shift
            for j in range(max(num_cached, end - need), min(num_full, end)):
                mask[j - num_cached] = True
    return mask


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """vLLM 0.33's positions a later request replaying a prompt can resume at, whose
    sliding-window tails sparse retention keeps: ``num_prompt_tokens - 1`` (a resend's
    cap); with EAGLE's drop the two aligned ends one block lower (a resend's, capped at
    ``num_prompt_tokens - 1``, and a longer sibling's), not below 0."""
    if not eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


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
