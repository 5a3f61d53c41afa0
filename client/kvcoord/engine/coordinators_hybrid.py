"""The hybrid coordinators (several distinct specs): vLLM 0.16's fixed-point search over
attention groups, and vLLM 0.33's (full attention cut at every group's size, sparse
retention, mamba and fine-grained hits)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .config import KVCacheConfig, attention_groups
from .coordinators_base import IdLists, KVCacheCoordinator
from .hash_list import hashes_at_block_size
from .managers import CrossAttentionManager, MambaManager033, SingleTypeKVCacheManager
from .managers.partial import find_partial_full_hit, find_partial_mamba_hit
from .request import Request
from .retention import replay_boundaries, window_block_mask
from .specs import AttentionSpec, FullAttentionSpec, SlidingWindowSpec


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
