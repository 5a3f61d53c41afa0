"""The invariants of semantics.md §7, checked on a live engine pool."""

from __future__ import annotations

from collections import Counter

from kvcoord.engine import FullAttentionSpec, KVCachePool
from kvcoord.engine.hash_list import hashes_at_block_size, key_with_group
from kvcoord.engine.managers import FullAttentionManager


def check_invariants(pool: KVCachePool, evicted: bool = False) -> None:
    """Raise AssertionError naming the first broken invariant.

    Args:
        pool: the pool to check.
        evicted: ``evict_blocks`` was used, which may leave shared or cached-position
            blocks without their hash (invariants 5 and 6 are then weaker).
    """
    bp = pool.block_pool
    null = bp.null_block
    sink = {b.block_id for m in pool.managers for b in getattr(m, "sink_blocks", ())}
    free_ids = bp.free_block_queue.head_ids()
    # 1. free queue: no duplicates, no null, exactly the zero-ref blocks.
    assert len(free_ids) == len(set(free_ids)), "free queue has duplicates"
    assert 0 not in free_ids, "null block in the free queue"
    assert null.block_hash is None, "null block is hashed"
    free = set(free_ids)
    # 2. ref counts equal holders; one group per block; once per list.
    holders: Counter[int] = Counter()
    group_of: dict[int, int] = {}
    for m in pool.managers:
        for rid, blocks in m.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            assert len(ids) == len(set(ids)), f"request {rid} holds a block twice in group {m.group_id}"
            for bid in ids:
                holders[bid] += 1
                assert group_of.setdefault(bid, m.group_id) == m.group_id, f"block {bid} in two groups"
            if isinstance(m, FullAttentionManager):
                assert all(not b.is_null for b in blocks), "null block in a full-attention list"
            elif blocks:
                # 8. nulls form a prefix of a sliding-window/chunked list (mamba align moves blocks).
                first_real = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
                if not getattr(m, "align", False):
                    assert all(not b.is_null for b in blocks[first_real:]), f"null after a block in {rid}"
    for block in bp.blocks[1:]:
        if block.block_id in sink:
            continue
        assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
        )
        assert (block.ref_cnt == 0) == (block.block_id in free), (
            f"block {block.block_id} free-queue membership"
        )
    # 3. free count.
    used = sum(1 for b in bp.blocks[1:] if b.ref_cnt > 0 and b.block_id not in sink)
    assert pool.num_free_blocks == len(free_ids) == bp.num_blocks - 1 - used - len(sink)
    # 4. hash map consistency.
    in_map: dict[int, bytes] = {}
    for key, ids in bp.cached_block_hash_to_block.items():
        assert ids, "empty hash-map entry"
        for bid in ids:
            assert bp.blocks[bid].block_hash == key, f"block {bid} key differs from its map entry"
            in_map[bid] = key
            gid = int.from_bytes(key[-4:], "big")
            if bid in group_of:
                assert group_of[bid] == gid, f"block {bid} cached for group {gid}, held in {group_of[bid]}"
    for block in bp.blocks:
        assert (block.block_hash is not None) == (block.block_id in in_map), (
            f"block {block.block_id} hash/map"
        )
    # 5-6. shared blocks came from the prefix cache; cached positions carry the request's keys.
    for m in pool.managers:
        position: dict[int, int] = {}
        for rid, blocks in m.req_to_blocks.items():
            req = pool.requests.get(rid)
            num_cached = m.num_cached_block.get(rid, 0)
            hashes = hashes_at_block_size(req.block_hashes, pool.hash_block_size, m.block_size) if req else []
            for i, b in enumerate(blocks):
                if b.is_null:
                    continue
                if holders[b.block_id] > 1 and not getattr(m, "align", False):
                    assert position.setdefault(b.block_id, i) == i, (
                        f"shared block {b.block_id} at two positions"
                    )
                    if not evicted:
                        assert b.block_hash is not None, f"shared block {b.block_id} is not cached"
                if i >= num_cached:
                    assert b.block_hash is None, f"{rid}: position {i} >= num_cached {num_cached} is hashed"
                elif not evicted and pool.enable_caching and i < len(hashes):
                    assert b.block_hash == key_with_group(hashes[i], m.group_id), f"{rid}: position {i} key"


def check_hit(pool: KVCachePool, num_tokens: int, block_ids: tuple[tuple[int, ...], ...], hit: int) -> None:
    """Invariant 7: hits are short of the prompt, aligned, and sized per group."""
    coordinator = pool.coordinator
    if not pool.enable_caching:
        assert hit == 0 and not any(block_ids)
        return
    assert hit <= max(num_tokens - 1, 0)
    assert hit % coordinator.alignment_tokens == 0
    first_full = None
    groups = getattr(coordinator, "attention_groups", None)
    if groups and isinstance(groups[0][0], FullAttentionSpec):
        first_full = set(groups[0][1])
    for gid, ids in enumerate(block_ids):
        bs = pool.config.groups[gid].block_size
        if (
            isinstance(pool.config.groups[gid], FullAttentionSpec)
            and first_full is not None
            and gid not in first_full
        ):
            assert len(ids) * bs >= hit
        else:
            assert len(ids) * bs == hit, f"group {gid}: {len(ids)} blocks for a {hit}-token hit"
