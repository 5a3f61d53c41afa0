"""The invariants an exact pool keeps (semantics.md §7), checked on a live pool.

:func:`check_pool` is read-only and returns every violation it finds as a sentence;
an empty list means the pool is consistent. The service exposes it to operators
(``CheckPool``); the test suite runs it after every property-test step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence

from .blocks import KVCacheBlock
from .config import attention_groups
from .hash_list import hashes_at_block_size, key_with_group, request_keys
from .managers import FullAttentionManager
from .pool import KVCachePool
from .profiles import VLLM_033
from .retention import window_block_mask
from .specs import MambaSpec, SlidingWindowSpec

__all__ = ["PoolCheck", "check_pool"]

#: A check stops collecting after this many violations (one broken rule usually
#: breaks many blocks; the first few say what happened).
MAX_VIOLATIONS = 100


@dataclasses.dataclass(frozen=True, slots=True)
class PoolCheck:
    """The result of :func:`check_pool`."""

    violations: tuple[str, ...]
    num_blocks: int
    num_requests: int
    num_cached_blocks: int

    @property
    def ok(self) -> bool:
        return not self.violations


def check_pool(pool: KVCachePool, evicted: bool | None = None) -> PoolCheck:
    """Check every invariant of ``pool``; changes nothing.

    Args:
        pool: the pool.
        evicted: ``evict_blocks`` was used, which may leave shared or cached-position
            blocks without their hash (invariants 5 and 6 are then weaker). Default:
            whether the pool has seen an ``evict_blocks`` call.

    Returns:
        The violations found (at most :data:`MAX_VIOLATIONS`) and what was checked.
    """
    if evicted is None:
        evicted = pool.evict_blocks_called
    out: list[str] = []

    def fail(message: str) -> bool:
        out.append(message)
        return len(out) >= MAX_VIOLATIONS

    bp = pool.block_pool
    null = bp.null_block
    sink = {b.block_id for m in pool.managers for b in getattr(m, "sink_blocks", ())}
    free_ids = bp.free_block_queue.head_ids()
    _check(pool, free_ids, sink, null, evicted, fail)
    return PoolCheck(tuple(out), bp.num_blocks, len(pool.requests), len(bp.cached_block_ids()))


def _check(
    pool: KVCachePool,
    free_ids: Sequence[int],
    sink: set[int],
    null: KVCacheBlock,
    evicted: bool,
    fail: Callable[[str], bool],
) -> bool:
    """The checks in order; returns True when enough violations were collected."""
    bp = pool.block_pool
    # 1. free queue: no duplicates, no null, exactly the zero-ref blocks.
    if len(free_ids) != len(set(free_ids)) and fail("the free queue holds a block twice"):
        return True
    if 0 in free_ids and fail("the null block is in the free queue"):
        return True
    if null.cached_hash is not None and fail("the null block is cached"):
        return True
    free = set(free_ids)
    # 2. ref counts equal holders; one group per block; once per list.
    holders: Counter[int] = Counter(pool.reservations.held_blocks())
    # copy-on-write pairs (vllm-0.33 partial hits): each end of a pair not yet taken,
    # and each block taken and not released, holds one reference
    holders.update(pool.retained)
    for cow in pool.cow_managers:
        for source, target in cow.pending_cow:
            holders[source.block_id] += 1
            holders[target.block_id] += 1
    group_of: dict[int, int] = {}
    for m in pool.managers:
        for rid, blocks in m.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if len(ids) != len(set(ids)) and fail(
                f"request {rid!r} holds a block twice in group {m.group_id}"
            ):
                return True
            for bid in ids:
                holders[bid] += 1
                if group_of.setdefault(bid, m.group_id) != m.group_id and fail(
                    f"block {bid} is held in groups {group_of[bid]} and {m.group_id}"
                ):
                    return True
            if isinstance(m, FullAttentionManager):
                if any(b.is_null for b in blocks) and fail(
                    f"request {rid!r}: a null block in full-attention group {m.group_id}"
                ):
                    return True
            elif blocks and not getattr(m, "align", False):
                # 8. nulls form a prefix of a sliding-window/chunked list (mamba align moves blocks).
                first_real = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
                if not all(not b.is_null for b in blocks[first_real:]) and fail(
                    f"request {rid!r}: a null block after a real one in group {m.group_id}"
                ):
                    return True
    for block in bp.blocks[1:]:
        bid = block.block_id
        if bid in sink:
            continue
        if block.ref_cnt != holders[bid] and fail(
            f"block {bid}: ref_cnt {block.ref_cnt} but {holders[bid]} block tables and retentions hold it"
        ):
            return True
        if (block.ref_cnt == 0) != (bid in free) and fail(
            f"block {bid}: ref_cnt {block.ref_cnt} but {'in' if bid in free else 'not in'} the free queue"
        ):
            return True
    # 3. free count.
    used = sum(1 for b in bp.blocks[1:] if b.ref_cnt > 0 and b.block_id not in sink)
    expected = bp.num_blocks - 1 - used - len(sink)
    if not pool.num_free_blocks == len(free_ids) == expected and fail(
        f"num_free_blocks {pool.num_free_blocks}, free queue length {len(free_ids)}, {expected} blocks unheld"
    ):
        return True
    # 4. hash map consistency.
    in_map: dict[int, bytes] = {}
    for key, entry in bp.cached_block_hash_to_block.items():
        if not entry and fail("an empty hash-map entry"):
            return True
        for cid in entry:
            cached = bp.get_block(cid)
            if (
                cached is None
                or (
                    cached.block_hash != key
                    and not bp.has_key(cached, key[:-4], int.from_bytes(key[-4:], "big"))
                )
            ) and fail(f"block {cid}: its key differs from its map entry"):
                return True
            in_map[cid] = key
            gid = int.from_bytes(key[-4:], "big")
            if (
                cid in group_of
                and group_of[cid] != gid
                and fail(f"block {cid} is cached for group {gid} but held in group {group_of[cid]}")
            ):
                return True
    for block in bp.blocks:
        if (block.block_hash is not None) != (block.block_id in in_map) and fail(
            f"block {block.block_id}: {'has a hash outside' if block.block_hash is not None else 'in'} the hash map"
            + ("" if block.block_hash is not None else " without a hash")
        ):
            return True
    # 5-6. shared blocks came from the prefix cache; cached positions carry the request's
    # keys (or, where retention is sparse, no key: _retains_sparsely).
    for m in pool.managers:
        position: dict[int, int] = {}
        # (vllm-0.33 sparse retention: a cached position may hold a live block not hashed)
        sparse = _retains_sparsely(pool, m.group_id)
        for rid, blocks in m.req_to_blocks.items():
            req = pool.requests.get(rid)
            num_cached = m.num_cached_block.get(rid, 0)
            kept = _dense_window_kept(pool, m.group_id, num_cached)
            hashes = (
                hashes_at_block_size(
                    request_keys(req.block_hashes, req.cache_prefix), pool.hash_block_size, m.block_size
                )
                # (only cached positions read them: a pool without caching has none, and
                # its hash block may be larger than a group's block, vllm-0.33's mamba
                # outside "align" making it the mamba block)
                if req and pool.enable_caching
                else []
            )
            for i, b in enumerate(blocks):
                if b.is_null:
                    continue
                if holders[b.block_id] > 1 and not getattr(m, "align", False):
                    if position.setdefault(b.block_id, i) != i and fail(
                        f"shared block {b.block_id} at two positions in group {m.group_id}"
                    ):
                        return True
                    if (
                        not evicted
                        and b.block_hash is None
                        and fail(f"shared block {b.block_id} is not cached")
                    ):
                        return True
                if i >= num_cached:
                    # a partial entry (vllm-0.33) keys a block not cached whole
                    if (
                        b.block_hash is not None
                        and b.block_id not in bp.partial_tokens
                        and fail(
                            f"request {rid!r}: position {i} >= num_cached {num_cached} in group {m.group_id} is cached"
                        )
                    ):
                        return True
                elif not evicted and pool.enable_caching and i < len(hashes):
                    if b.block_hash is None:
                        if (
                            not sparse
                            and (kept is None or kept[i])
                            and fail(
                                f"request {rid!r}: block {b.block_id} at position {i} < num_cached "
                                f"{num_cached} in group {m.group_id} is not cached"
                            )
                        ):
                            return True
                    elif b.block_hash != key_with_group(hashes[i], m.group_id) and fail(
                        f"request {rid!r}: block {b.block_id} at position {i} of group {m.group_id} is "
                        "cached under another key than the request's"
                    ):
                        return True
    return False


def _retains_sparsely(pool: KVCachePool, group_id: int) -> bool:
    """Whether group ``group_id`` may hold live blocks without a hash below a request's
    cached count: a sliding-window or mamba group of a vllm-0.33 pool whose
    ``prefix_cache_retention_interval`` is not ``None`` (sparse, 0, or periodic). (Dense
    retention's window groups: :func:`_dense_window_kept`.)

    Such a group's caching step advances the request's cached count over every newly
    full block but hashes only those its retention keeps (a sliding-window tail per
    segment and at the replay boundaries; a mamba state only at a reachable boundary:
    the prompt's replay boundary or the shared-prefix junction); vLLM 0.33.0's
    ``BlockPool.cache_full_blocks`` skips the others like null blocks, and its
    ``num_cached_block`` counts them all. So a live, unhashed block at a cached
    position is vLLM's own state there, e.g. the mamba state block a first allocation
    with external tokens adopts at position 0 (live until the next step frees it) or
    the running state block once decode fills its block. A block that is hashed at
    such a position must still carry the request's key: that check is not relaxed."""
    config = pool.config
    return (
        config.profile == VLLM_033
        and config.prefix_cache_retention_interval is not None
        and isinstance(config.groups[group_id], (SlidingWindowSpec, MambaSpec))
    )


def _dense_window_kept(pool: KVCachePool, group_id: int, num_cached: int) -> list[bool] | None:
    """Under dense retention (``None``) in a vllm-0.33 pool with more than one group, which
    of a sliding-window group's first ``num_cached`` positions are hashed (``None``: all
    of them, or not such a group). Dense retention keeps, per scheduler block, the last
    blocks a hit of the window needs (:func:`~kvcoord.engine.retention.window_block_mask`,
    EAGLE's drop included), so where those are fewer than a scheduler block holds the
    others are live and unhashed below the cached count, in vLLM 0.33.0's manager as in
    the pool. (One group: the scheduler block is the group's block, always kept whole.)"""
    config = pool.config
    spec = config.groups[group_id]
    if (
        config.profile != VLLM_033
        or config.prefix_cache_retention_interval is not None
        or not isinstance(spec, SlidingWindowSpec)
        or len(config.groups) == 1
    ):
        return None
    scheduler = config.scheduler_block_size or math.lcm(*(g.block_size for g in config.groups))
    ids = next(ids for _, ids in attention_groups(config.groups) if group_id in ids)
    return window_block_mask(
        spec.sliding_window, spec.block_size, scheduler, None, 0, num_cached, (), config.eagle_drops(ids)
    )
