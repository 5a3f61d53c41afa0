"""An EAGLE reservation holds what the search reads, not what lies past a gap.

With EAGLE a hit depends on the block its search dropped, so a reservation also holds
the cached blocks the search reads beyond the hit. A full-attention search stops at
the first block that is not cached (and caps every other group's search): the blocks
cached under the prompt's hashes after that gap are never read. They used to be held
all the same (every block cached under the hashes up to the search's reach): blocks no
request of that prompt could be given were taken out of the free queue for the
reservation's time (up to max_reservation_seconds), counted as used, and on release put
back at the queue's tail, where vLLM's queue never moves an unread block.
"""

from __future__ import annotations

import random

import pytest
from invariants import check_invariants
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.engine.config import ConfigError
from kvcoord.engine.profiles import VLLM_016, VLLM_033

NONE = none_hash("sha256_cbor", "0")


def _config(hybrid: bool) -> KVCacheConfig:
    groups = (FullAttentionSpec(4), SlidingWindowSpec(4, 8)) if hybrid else (FullAttentionSpec(4),)
    return KVCacheConfig(
        num_blocks=30,
        groups=groups,
        hash_block_size=4,
        enable_caching=True,
        use_eagle=True,
        enable_kv_cache_events=False,
        max_model_len=96,
    )


def _gapped_pool(
    hybrid: bool, gap: int
) -> tuple[KVCachePool, list[int], list[bytes], tuple[tuple[int, ...], ...]]:
    """A pool that cached a 6-block prompt (and one token), then lost the full-attention
    block at position ``gap`` (EvictBlocksOp, a connector's failed load): the prompt, its
    hashes and the warm request's blocks per group."""
    pool = KVCachePool(_config(hybrid))
    tokens = list(range(100, 125))  # 6 full blocks of 4 and 1 token
    hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)
    pool.add_request("warm", tokens, hashes)
    assert pool.allocate_slots("warm", len(tokens), 0, pool.get_computed_blocks("warm")) is not None
    table = tuple(tuple(ids) for ids in pool.get_block_ids("warm"))
    pool.cache_blocks("warm", len(tokens))
    pool.free("warm")
    pool.evict_blocks([table[0][gap]])
    return pool, tokens, hashes, table


def test_a_unitary_eagle_reservation_holds_nothing_past_the_gap() -> None:
    """The search matches blocks 0 and 1, misses block 2 and drops block 1 (EAGLE): a
    hit of one block that depends on blocks 0 and 1 alone; blocks 3 to 5 stay free."""
    pool, tokens, hashes, table = _gapped_pool(hybrid=False, gap=2)
    free_before = pool.num_free_blocks
    hit = pool.reserve("res", hashes, len(tokens))
    assert hit == pool.find_longest_cache_hit(hashes, len(tokens))
    assert hit.num_tokens == 4
    held = pool.reservations.live["res"].held
    assert held == (table[0][:2],), f"held {held}, the search reads {table[0][:2]}"
    assert pool.num_free_blocks == free_before - 2
    check_invariants(pool)
    assert pool.release_reservation("res")
    assert pool.num_free_blocks == free_before
    check_invariants(pool)


def test_a_hybrid_eagle_reservation_holds_nothing_past_the_full_attention_gap() -> None:
    """Full attention then a sliding window, EAGLE: full attention's run ends at block
    3 and caps the sliding window's search, so no block of either group at position 3
    or later is read (the sliding window's blocks there are cached, unread)."""
    pool, tokens, hashes, table = _gapped_pool(hybrid=True, gap=3)
    free_before = pool.num_free_blocks
    hit = pool.reserve("res", hashes, len(tokens))
    assert hit == pool.find_longest_cache_hit(hashes, len(tokens))
    assert hit.num_tokens > 0
    held = pool.reservations.live["res"].held
    past_gap = {b for ids in table for b in ids[3:]}
    assert not past_gap & {b for ids in held for b in ids}, f"held {held}, past the gap {past_gap}"
    # what the search read is still held: the hit and the blocks it dropped
    assert all(set(ids) <= set(h) for ids, h in zip(hit.block_ids, held, strict=True))
    assert pool.num_free_blocks == free_before - sum(len(ids) for ids in held)
    check_invariants(pool)
    assert pool.release_reservation("res")
    assert pool.num_free_blocks == free_before


_LAYOUTS = [
    (FullAttentionSpec(4),),
    (FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
    (FullAttentionSpec(4), SlidingWindowSpec(4, 16)),
    (FullAttentionSpec(4), SlidingWindowSpec(8, 16)),
    (FullAttentionSpec(8), SlidingWindowSpec(4, 8)),
    (FullAttentionSpec(4), SlidingWindowSpec(16, 32)),
    (FullAttentionSpec(4), SlidingWindowSpec(4, 8), SlidingWindowSpec(4, 32)),
    (FullAttentionSpec(4), FullAttentionSpec(4, num_kv_heads=2), SlidingWindowSpec(8, 16)),
    (SlidingWindowSpec(4, 8),),
]


@pytest.mark.parametrize("profile", [VLLM_016, VLLM_033])
def test_an_eagle_reservation_holds_every_block_its_hit_depends_on(profile: str) -> None:
    """Random layouts (both profiles; a vllm-0.33 hybrid's groups peek a block past
    the full-attention run), prompts cached, then a few cached blocks evicted (gaps):
    once every free cached block the reservation does not hold is evicted too, the
    prompt's hit is the one reserved, block for block."""
    rnd = random.Random(7)
    checked = 0
    for _ in range(400):
        try:
            config = KVCacheConfig(
                num_blocks=rnd.randint(30, 80),
                groups=rnd.choice(_LAYOUTS),
                hash_block_size=4,
                enable_caching=True,
                use_eagle=True,
                enable_kv_cache_events=False,
                max_model_len=200,
                profile=profile,
            )
        except ConfigError:  # (a layout the profile does not model with EAGLE)
            continue
        pool = KVCachePool(config)
        base = [rnd.randrange(3) for _ in range(rnd.randint(8, 60))]
        for j in range(rnd.randint(1, 4)):
            tokens = base[: rnd.randint(1, len(base))] + [rnd.randrange(3) for _ in range(rnd.randint(0, 10))]
            rid = f"warm{j}"
            pool.add_request(rid, tokens, BlockHasher("sha256_cbor", 4, NONE).extend(tokens))
            if pool.allocate_slots(rid, len(tokens), 0, pool.get_computed_blocks(rid)) is not None:
                pool.cache_blocks(rid, len(tokens))
            pool.free(rid)
        cached = sorted(pool.block_pool.cached_block_hash_to_block.block_ids())
        pool.evict_blocks(rnd.sample(cached, min(len(cached), rnd.randint(0, 3))))
        tokens = base + [rnd.randrange(3) for _ in range(rnd.randint(1, 10))]
        hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)
        hit = pool.reserve("res", hashes, len(tokens))
        if not hit.num_tokens:
            continue
        held = {b for ids in pool.reservations.live["res"].held for b in ids}
        blocks = pool.block_pool.blocks
        pool.evict_blocks(
            b
            for b in pool.block_pool.cached_block_hash_to_block.block_ids()
            if b not in held and not blocks[b].ref_cnt
        )
        assert pool.find_longest_cache_hit(hashes, len(tokens)) == hit, (config, tokens)
        checked += 1
    assert checked >= 100, checked
