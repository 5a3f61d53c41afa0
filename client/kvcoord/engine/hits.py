"""Prefix hits: finding them, counting lookups, and turning a hit back into blocks.

vLLM's ``KVCacheManager.get_computed_blocks`` searches the cache and records the
lookup's statistics; its scheduler then passes the blocks it got to
``allocate_slots``. A remote caller passes block *ids* back instead, possibly after
other calls changed the cache, so :meth:`PrefixHits.resolve` checks every id is
still cached under the request's hash before the pool adopts it (unless nothing
could have changed since the request's own lookup).
"""

from __future__ import annotations

from collections.abc import Sequence

from .blocks import KVCacheBlock
from .config import KVCacheConfig
from .coordinators import KVCacheCoordinator
from .errors import FailedPreconditionError, HintMismatchError, InvalidArgumentError, StaleCacheHitError
from .events import BlockStored
from .hash_list import NAMESPACE_PREFIX_BYTES, SharedHashes, hashes_at_block_size, request_keys
from .managers import CrossAttentionManager, FullAttentionManager
from .profiles import VLLM_016, rules_of
from .request import Request
from .request_table import RequestTable
from .results import BlockIds, CacheHit, new_hit
from .stats import LookupCounters, PrefixCacheStats

__all__ = ["PrefixHits"]


#: the namespace prefix never assigned (assignment starts at 1)
_UNUSED_PREFIX = bytes(NAMESPACE_PREFIX_BYTES)


class PrefixHits:
    """Prefix-hit search, lookup statistics, and checks on hits handed back.

    Owns the lookup statistics: :attr:`prefix_cache_stats` (``None`` unless the
    config logs stats; the pool swaps it out) and the lifetime :attr:`lookup_counters`.

    Args:
        config: the pool's validated layout.
        coordinator: the pool's coordinator (its block pool and managers are read).
        table: the pool's request table, for hash validation.
    """

    def __init__(self, config: KVCacheConfig, coordinator: KVCacheCoordinator, table: RequestTable) -> None:
        self.coordinator = coordinator
        self.block_pool = coordinator.block_pool
        self.managers = coordinator.managers
        self.table = table
        self.enable_caching = config.enable_caching
        self.max_model_len = config.max_model_len
        self.hash_block_size = config.hash_block_size
        self.use_eagle = config.use_eagle
        self._hybrid = config.coordinator_kind == "hybrid"
        self._partial = config.partial_hash_hits
        #: vllm-0.33 hybrids: an EAGLE search peeks up to the request's hashed tokens
        self._peek_to_hashes = self._hybrid and config.profile != VLLM_016
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if config.log_stats else None
        #: vllm-0.33: statistics count admissions (record_admission), not lookups
        self._stats_at_lookup = not rules_of(config.profile).stats_at_admission
        #: vllm-0.33 hybrids report a shared prefix a sparse group lags behind
        self._junctions = getattr(coordinator, "last_longest_hit", None) is not None
        #: vllm-0.33 with events: a "full" report-mode request's hits are re-announced
        self._hit_events = rules_of(config.profile).hit_events and config.enable_kv_cache_events
        self.lookup_counters = LookupCounters(group_hit_tokens=[0] * len(config.groups))
        self._alignment = coordinator.alignment_tokens
        self._group_block_sizes = [g.block_size for g in config.groups]
        self._no_hit_blocks: BlockIds = tuple(() for _ in self.managers)
        #: the empty hit, made once (frozen: a router's score of a pool without the
        #: prompt's start returns it instead of a new object per pool per call)
        self._no_hit = CacheHit(self._no_hit_blocks, 0)
        #: (group id, block size) of the group the coordinator searches first when it is
        #: full attention (whose hit is a run of cached blocks from position 0, and
        #: every other group's search is capped by it): a miss of the first key there
        #: means no hit at all. None when the first search is of another type.
        self.first_full: tuple[int, int] | None = None
        if config.coordinator_kind == "unitary" and type(self.managers[0]) is FullAttentionManager:
            self.first_full = (0, self._group_block_sizes[0])
        elif self._hybrid:
            _spec, ids, cls = coordinator.attention_groups[0]  # type: ignore[attr-defined]
            # (with fine-grained hits a hit may end inside the first block)
            if cls is FullAttentionManager and not self._partial:
                self.first_full = (ids[0], self._group_block_sizes[ids[0]])

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], num_tokens: int, cache_namespace: str = ""
    ) -> CacheHit:
        """The hit a request of ``num_tokens`` tokens with these hashes would get,
        after checking both; changes and records nothing.

        Raises:
            InvalidArgumentError: see :meth:`KVCachePool.find_longest_cache_hit`.
        """
        keys = self.lookup_keys(block_hashes, num_tokens, cache_namespace)
        if keys is None:
            return self._no_hit
        first = self.first_full
        if first is not None:
            gid, size = first
            view = hashes_at_block_size(keys, self.hash_block_size, size)
            if (
                num_tokens - 1 < size
                or not view
                or view[0] not in self.block_pool.cached_block_hash_to_block.first[gid]
            ):
                return self._no_hit
        hit, _ = self.search(keys, num_tokens)
        return hit

    def lookup_keys(
        self, block_hashes: Sequence[bytes], num_tokens: int, cache_namespace: str = ""
    ) -> Sequence[bytes] | None:
        """The cache keys :meth:`find_longest_cache_hit` searches for (the hashes under
        the namespace's prefix), after the same checks; ``None`` when caching is off.

        Raises:
            InvalidArgumentError: see :meth:`KVCachePool.find_longest_cache_hit`.
        """
        if type(num_tokens) is not int:
            raise InvalidArgumentError(f"num_tokens must be an integer, got {type(num_tokens).__name__}")
        if not 1 <= num_tokens <= self.max_model_len:
            raise InvalidArgumentError(
                f"num_tokens must be between 1 and max_model_len {self.max_model_len}, got {num_tokens}"
            )
        if isinstance(block_hashes, (bytes, str)):
            raise InvalidArgumentError("block_hashes must be a sequence of bytes, not a single value")
        table = self.table
        hashes: Sequence[bytes]
        if type(block_hashes) is SharedHashes:
            # one prompt scored in many pools: each distinct check runs once per call
            key = ("check", self.enable_caching, self.hash_block_size, table.hash_length, num_tokens)
            if not block_hashes.passed(key):
                block_hashes.checked(
                    key,
                    lambda: table.check_hashes(block_hashes, 0, num_tokens, f"lookup of {num_tokens} tokens"),
                )
            hashes = block_hashes
        else:
            hashes = table.check_hashes(block_hashes, 0, num_tokens, f"lookup of {num_tokens} tokens")
        if not self.enable_caching:
            return None
        # A namespace not seen yet has cached nothing: its keys take the prefix no
        # namespace is ever given (0), so the same search finds nothing, read-only.
        prefix = table.cache_namespaces.get(cache_namespace, _UNUSED_PREFIX) if cache_namespace else b""
        return request_keys(hashes, prefix)

    def search(self, block_hashes: Sequence[bytes], num_tokens: int) -> tuple[CacheHit, list[list[int]]]:
        """The coordinator's search for a request of ``num_tokens >= 1`` tokens (caching
        on): the hit, and the same block ids as the coordinator's per-group lists."""
        lists, hit = self.coordinator.find_longest_cache_hit(block_hashes, num_tokens - 1)
        return new_hit(tuple(map(tuple, lists)), hit), lists

    def lookup(self, req: Request) -> CacheHit:
        """The request's hit, recorded (an empty, unrecorded hit when caching is off or
        the request skips reading the prefix cache)."""
        if not self.enable_caching or req.skip_reading_prefix_cache:
            req.shared_prefix_boundary = 0
            return CacheHit(self._no_hit_blocks, 0)
        hit, lists = self.search(request_keys(req.block_hashes, req.cache_prefix), len(req.all_token_ids))
        if self._junctions:
            self.note_junction(req, hit.num_tokens)
        self.record_lookup(req, hit, lists)
        if self._hit_events and req.kv_cache_report_full:
            self.block_pool.kv_event_queue += self.hit_events(req, hit)
        return hit

    def hit_events(self, req: Request, hit: CacheHit) -> list[BlockStored]:
        """vLLM 0.33's ``get_computed_blocks`` for a request in the "full" report mode
        (``kv_cache_report_full``), KV events on: a hit of one token or more is
        re-announced, one BlockStored per group whose hit is not empty (its every
        position from block 0, no parent: :meth:`BlockPool.hit_stored_event`). Empty
        otherwise, and in vllm-0.16 pools (vLLM 0.16 has no report mode). Queues
        nothing: the lookup queues them, before anything the request's allocation
        queues."""
        if not (self._hit_events and req.kv_cache_report_full and hit.num_tokens):
            return []
        stored = self.block_pool.hit_stored_event
        sizes = self._group_block_sizes
        return [stored(req, len(ids), sizes[gid], gid) for gid, ids in enumerate(hit.block_ids) if ids]

    def note_junction(self, req: Request, hit_tokens: int) -> None:
        """vLLM 0.33: after a lookup the request keeps ``shared_prefix_boundary``, the
        longest length any group found when a sparse group stopped shorter (0 when
        none, and always 0 outside vllm-0.33 hybrids)."""
        if self._junctions:
            longest: int = self.coordinator.last_longest_hit  # type: ignore[attr-defined]
            req.shared_prefix_boundary = longest if longest > hit_tokens else 0

    def hint(self, req: Request, walk_limit: int) -> tuple[CacheHit, int]:
        """The request's hit, recorded nowhere, and its eviction margin.

        The margin is how many blocks may leave the free queue (allocated from its head,
        or taken out of it by adopted hits) before a block of this hit that is free now
        could be reused: the free blocks ahead of the first of them (``walk_limit``
        caps the walk, and the margin). Blocks held now are not counted: one freed
        later goes to the tail, behind every block then free, which the caller knows
        better (at most the free blocks now, when it knows nothing of its frees).
        """
        limit = max(walk_limit, 0)
        if not self.enable_caching or req.skip_reading_prefix_cache:
            return CacheHit(self._no_hit_blocks, 0), limit
        keys = request_keys(req.block_hashes, req.cache_prefix)
        hit, lists = self.search(keys, len(req.all_token_ids))
        blocks = self.block_pool.blocks
        free = {bid for ids in hit.block_ids for bid in ids if bid and not blocks[bid].ref_cnt}
        if self.use_eagle and self._hybrid:
            # Each pass of the fixed point drops a block of its own, which the final
            # lists do not show: count every block cached under the request's hashes
            # (no other block can change the search), held ones capping the margin.
            under, held = self._cached_under(keys, self.eagle_reach(keys, len(req.all_token_ids)))
            if held:
                limit = min(limit, self.block_pool.get_num_free_blocks())
            return hit, self.block_pool.free_block_queue.first_position(free | under, limit)
        if self.use_eagle:
            dropped = self._dropped_by_eagle(keys, lists)
            free |= {b for b in dropped if not blocks[b].ref_cnt}
            if any(blocks[b].ref_cnt for b in dropped):
                # A dropped block held now: the caller does not see it freed (it knows
                # the hit's blocks only). Once freed it waits behind every block free
                # now, so at most that many may move.
                limit = min(limit, self.block_pool.get_num_free_blocks())
        return hit, self.block_pool.free_block_queue.first_position(free, limit)

    def eagle_reach(self, keys: Sequence[bytes], num_tokens: int) -> int:
        """How many tokens a hybrid search with EAGLE's drop may read: ``num_tokens - 1``;
        vllm-0.33's may peek a block past that, up to the request's hashed tokens."""
        if self._peek_to_hashes:
            return max(num_tokens - 1, len(keys) * self.hash_block_size)
        return num_tokens - 1

    def _cached_under(self, keys: Sequence[bytes], max_tokens: int) -> tuple[set[int], bool]:
        """The free blocks cached under the request's hashes that a search of up to
        ``max_tokens`` tokens could read, per group at its block size, and whether any
        such block is held now."""
        free: set[int] = set()
        held = False
        blocks = self.block_pool.blocks
        for ids in self.cached_under(keys, max_tokens):
            for b in ids:
                if blocks[b].ref_cnt:
                    held = True
                else:
                    free.add(b)
        return free, held

    def cached_under(self, keys: Sequence[bytes], max_tokens: int) -> list[list[int]]:
        """Per group, in position order, every block cached under the request's keys
        that a search of up to ``max_tokens`` tokens reads (with EAGLE a hit depends on
        these: each search drops the block it matched last)."""
        first = self.block_pool.cached_block_hash_to_block.first
        out = []
        for gid, size in enumerate(self._group_block_sizes):
            get = first[gid].get
            view = hashes_at_block_size(keys, self.hash_block_size, size)
            out.append([b for h in view[: max_tokens // size] if (b := get(h))])
        return out

    def _dropped_by_eagle(self, keys: Sequence[bytes], lists: list[list[int]]) -> set[int]:
        """With EAGLE each group's hit drops its last matched block, so the hit also
        depends on that block (evicting it shortens the match, and the hit with it):
        per group, the block cached under the hash right after the hit, for a unitary
        coordinator (one spec, no alignment: the lists are exactly the hit)."""
        out: set[int] = set()
        get = self.block_pool.get_cached_block
        for gid, (lst, size) in enumerate(zip(lists, self._group_block_sizes, strict=True)):
            view = hashes_at_block_size(keys, self.hash_block_size, size)
            if len(lst) < len(view):
                cached = get(view[len(lst)], (gid,))
                if cached is not None and cached[0]:
                    out.add(cached[0])
        return out

    def check_answered(self, req: Request, answered: CacheHit) -> CacheHit:
        """A lookup the client answered itself (from a hint it could prove still holds):
        search now, require the same hit, and record the lookup as :meth:`lookup` does.

        Raises:
            HintMismatchError: the hit now differs (nothing is recorded or changed).
        """
        if not self.enable_caching or req.skip_reading_prefix_cache:
            hit = CacheHit(self._no_hit_blocks, 0)
            lists: list[list[int]] = [[] for _ in self.managers]
        else:
            hit, lists = self.search(request_keys(req.block_hashes, req.cache_prefix), len(req.all_token_ids))
        given = tuple(tuple(ids) for ids in answered.block_ids)
        if hit.num_tokens != answered.num_tokens or hit.block_ids != given:
            raise HintMismatchError(
                f"request {req.request_id!r}: the client answered its lookup with a hit of "
                f"{answered.num_tokens} tokens {given}, the pool has {hit.num_tokens} tokens {hit.block_ids}"
            )
        if self.enable_caching and not req.skip_reading_prefix_cache:
            self.note_junction(req, hit.num_tokens)
            self.record_lookup(req, hit, lists)
            if self._hit_events and req.kv_cache_report_full:
                self.block_pool.kv_event_queue += self.hit_events(req, hit)
        else:
            req.shared_prefix_boundary = 0
        return hit

    def record_lookup(self, req: Request, hit: CacheHit, lists: list[list[int]]) -> None:
        """Statistics and counters of one lookup; remembers the hit for adoption."""
        req.last_hit = (hit.block_ids, self.block_pool.hash_epoch)
        num_tokens = len(req.all_token_ids)
        hit_tokens = hit.num_tokens
        if self.prefix_cache_stats is not None and self._stats_at_lookup:
            self.prefix_cache_stats.record(num_tokens, hit_tokens, req.num_preemptions > 0)
        c = self.lookup_counters
        c.lookups += 1
        c.queries += num_tokens
        c.hits += hit_tokens
        if num_tokens - 1 < self._alignment:
            c.short_lookups += 1
        group_hits = c.group_hit_tokens
        for g, lst in enumerate(lists):
            if lst:
                group_hits[g] += len(lst) * self._group_block_sizes[g]

    def record_admission(self, req: Request, num_hits: int) -> None:
        """vLLM 0.33's statistics of an admitted request's lookup (``num_hits`` tokens)."""
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(len(req.all_token_ids), num_hits, req.num_preemptions > 0)

    def check_adoption(self, request_id: str, hit_blocks: list[list[KVCacheBlock]]) -> None:
        """A hit or external tokens are adopted only by a request holding no blocks yet
        (an admitted request, one with cached blocks, skips adoption and must bring no hit).

        Raises:
            FailedPreconditionError: the request already holds blocks in a group.
        """
        for m, hit in zip(self.managers, hit_blocks, strict=False):
            if isinstance(m, CrossAttentionManager):
                continue  # adopts nothing: its blocks come from the encoder
            if request_id in m.num_cached_block:
                ok = not hit
            else:
                ok = not m.req_to_blocks.get(request_id)
            if not ok:
                raise FailedPreconditionError(
                    f"group {m.group_id}: request {request_id!r} already holds blocks; prefix "
                    "hits and external tokens are adopted only by a request's first allocation"
                )

    def resolve(
        self,
        req: Request,
        hit: CacheHit | Sequence[Sequence[int]] | None,
        num_new_computed_tokens: int,
    ) -> list[list[KVCacheBlock]]:
        """Turn a hit's block ids back into blocks, checking each is still cached.

        Raises:
            InvalidArgumentError: a malformed hit (group count, ids, lengths) or one
                given while caching is off.
            StaleCacheHitError: a block no longer holds this prefix's hash.
        """
        n = len(self.managers)
        if hit is None:
            lists: Sequence[Sequence[int]] = [()] * n
        elif isinstance(hit, CacheHit):
            lists = hit.block_ids
        else:
            lists = hit
        if len(lists) != n:
            raise InvalidArgumentError(
                f"new_computed_blocks must have one list per KV cache group ({n}), got {len(lists)}"
            )
        if not any(lists):
            if num_new_computed_tokens:
                raise InvalidArgumentError(
                    "num_new_computed_tokens is > 0 but no prefix-hit blocks were given"
                )
            return [[] for _ in range(n)]
        if not self.enable_caching:
            raise InvalidArgumentError("prefix caching is off: new_computed_blocks must be empty")
        bp = self.block_pool
        blocks = bp.blocks
        # The request's own last lookup, and no cached hash dropped since: every block
        # still holds the key it was found under, so the per-block check can be skipped.
        last = req.last_hit
        trusted = (
            last is not None
            and last[1] == bp.hash_epoch
            and (lists is last[0] or tuple(map(tuple, lists)) == last[0])
        )
        out: list[list[KVCacheBlock]] = []
        for m, ids in zip(self.managers, lists, strict=False):
            if isinstance(m, CrossAttentionManager) and ids:
                raise InvalidArgumentError(f"group {m.group_id}: cross-attention has no prefix hits")
            if len(ids) * m.block_size < num_new_computed_tokens:
                raise InvalidArgumentError(
                    f"group {m.group_id}: {len(ids)} hit blocks cover fewer than "
                    f"num_new_computed_tokens={num_new_computed_tokens} tokens"
                )
            if len(ids) * m.block_size > req.num_tokens and not (
                self._partial and (len(ids) - 1) * m.block_size < req.num_tokens  # a partial tail
            ):
                raise InvalidArgumentError(
                    f"group {m.group_id}: {len(ids)} hit blocks but the request has only "
                    f"{req.num_tokens // m.block_size} full blocks"
                )
            if trusted:
                out.append([blocks[bid] for bid in ids])
                continue
            keys = request_keys(req.block_hashes, req.cache_prefix)
            hashes = hashes_at_block_size(keys, self.hash_block_size, m.block_size)
            resolved = []
            gid = m.group_id
            # fine-grained hits: a hit ending inside a block names it under the key of
            # the hash block ending there (a partial entry)
            tail = len(ids) - 1 if self._partial and ids and num_new_computed_tokens % m.block_size else -1
            for pos, bid in enumerate(ids):
                if isinstance(bid, bool) or not isinstance(bid, int) or not 0 <= bid < bp.num_blocks:
                    raise InvalidArgumentError(f"group {gid}: invalid block id {bid!r}")
                if bid == 0:
                    if not m.uses_null_blocks:
                        raise InvalidArgumentError(
                            f"group {gid}: the null block cannot be part of a full-attention hit"
                        )
                    resolved.append(bp.null_block)
                    continue
                block = bp.get_block(bid)
                if pos == tail:
                    ok = block is not None and bp.has_key(
                        block, keys[num_new_computed_tokens // self.hash_block_size - 1], gid
                    )
                else:
                    ok = block is not None and block.cached_hash == hashes[pos] and block.cached_group == gid
                if block is None or not ok:
                    raise StaleCacheHitError(
                        f"group {gid}: block {bid} at position {pos} is no longer "
                        "cached for this request's prefix; look up again (or allocate "
                        "with an atomic lookup)"
                    )
                resolved.append(block)
            out.append(resolved)
        return out
