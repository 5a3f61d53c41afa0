"""Reservations in the engine: a reserved hit survives any allocation storm until it is
released or adopted, its references are counted like a request's, and releasing them
all leaves a sound pool."""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from invariants import check_invariants
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool
from strategies import PREFIXES, H, configs
from test_lookup_and_lazy_blocks import drive

NONE = none_hash("sha256_cbor", "0")

#: one full-attention group with EAGLE, a pool of 15 blocks (found by Hypothesis)
EAGLE_15 = KVCacheConfig(
    num_blocks=15,
    groups=(FullAttentionSpec(4),),
    hash_block_size=H,
    enable_caching=True,
    use_eagle=True,
    enable_kv_cache_events=False,
    max_model_len=96,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.randoms(use_true_random=False), st.integers(10, 60))
# A request of a shorter prompt (3 hashes, 12 tokens: its hit is 1 block) used to adopt
# the reservation of a longer prompt sharing its first 2 blocks (promised 2 blocks):
# a short hit counted, and the longer prompt's reservation gone before its time.
@example(EAGLE_15, random.Random(48), 43)
def test_a_reserved_hit_survives_an_allocation_storm(
    config: KVCacheConfig, rnd: random.Random, steps: int
) -> None:
    """A random scheduler allocates, preempts and frees in a small pool (so cached
    blocks are evicted all the time) while prompts are reserved, adopted by requests
    and released at random: before every lookup each live reservation's prompt still
    hits at least what was reserved (every layout, EAGLE included), the pool's
    invariants hold with the reservations' references counted, an adopting request
    gets at least the reserved hit (the oldest reservation of its own prompt, the
    promise made to it, is the one it adopts), and at the end releasing every
    reservation leaves every block free. (EvictBlocksOp, which drops a hash whoever holds the block, is
    left out of the storm.)"""
    ids = itertools.count()  # per example: the same names (and their order) when replayed
    pool = KVCachePool(config)
    pool.evict_blocks = lambda ids: None  # type: ignore[method-assign]
    live: dict[str, tuple[list[int], list[bytes], int]] = {}

    def check() -> None:
        for tokens, hashes, reserved in live.values():
            assert pool.find_longest_cache_hit(hashes, len(tokens)).num_tokens >= reserved
        check_invariants(pool)

    def probe(pool: KVCachePool, rid: str) -> None:
        check()
        roll = rnd.random()
        if roll < 0.5:
            tokens = (rnd.choice(PREFIXES) + [rnd.randrange(4) for _ in range(rnd.randint(1, 12))])[:60]
            hashes = BlockHasher("sha256_cbor", H, NONE).extend(tokens)
            res = f"res{next(ids)}"
            hit = pool.reserve(res, hashes, len(tokens))
            assert hit == pool.find_longest_cache_hit(hashes, len(tokens))
            if hit.num_tokens:
                live[res] = (tokens, hashes, hit.num_tokens)
            else:
                assert res not in pool.reservations.live
        elif roll < 0.7 and live:
            res = rnd.choice(sorted(live))
            assert pool.release_reservation(res)
            del live[res]
        elif roll < 0.9 and live:
            # a request of a reserved prompt arrives: its first allocation adopts it
            res = rnd.choice(sorted(live))
            tokens, hashes, reserved = live[res]
            req = f"adopt{next(ids)}"
            pool.add_request(req, tokens, hashes)
            hit = pool.get_computed_blocks(req)
            assert hit.num_tokens >= reserved
            if pool.allocate_slots(req, len(tokens) - hit.num_tokens, hit.num_tokens, hit) is not None:
                # the oldest reservation of this prompt (the same hashes and tokens)
                oldest = next(r for r, (t, h, _) in live.items() if h == hashes and len(t) == len(tokens))
                adopted = pool.adopt_reservation(req, hit.num_tokens)
                assert adopted is not None and adopted.reservation_id == oldest
                del live[oldest]
            pool.free(req)
        check()

    drive(pool, rnd, steps, probe)
    check()
    assert pool.reservations.counters.short_hits == 0
    for res in sorted(live):
        assert pool.release_reservation(res)
    assert not pool.reservations.live
    check_invariants(pool)
    assert pool.num_free_blocks == KVCachePool(config).num_free_blocks


def test_a_shorter_prompt_sharing_the_hit_leaves_the_reservation_to_its_prompt() -> None:
    """EAGLE drops a hit's last matched block, so a prompt sharing only a reserved
    hit's blocks is promised less than that hit. Its request must not adopt (and end)
    the reservation made for the longer prompt: that prompt's hit still survives an
    allocation that takes every other block, and its own request adopts it."""
    pool = KVCachePool(EAGLE_15)
    long_tokens = list(range(100, 117))  # 4 full blocks and 1 token: searched up to 16
    long_hashes = BlockHasher("sha256_cbor", H, NONE).extend(long_tokens)
    pool.add_request("warm", long_tokens, long_hashes)
    assert pool.allocate_slots("warm", len(long_tokens), 0, pool.get_computed_blocks("warm")) is not None
    pool.free("warm")
    promised = pool.reserve("long", long_hashes, len(long_tokens))
    assert promised == pool.find_longest_cache_hit(long_hashes, len(long_tokens))
    assert promised.num_tokens > 0

    short_tokens = long_tokens[: promised.num_tokens] + [7]  # the hit's blocks and 1 token
    short_hashes = BlockHasher("sha256_cbor", H, NONE).extend(short_tokens)
    assert short_hashes[-1] == long_hashes[len(short_hashes) - 1]
    pool.add_request("short", short_tokens, short_hashes)
    hit = pool.get_computed_blocks("short")
    assert hit.num_tokens < promised.num_tokens  # EAGLE: the short prompt's own answer
    assert pool.allocate_slots("short", len(short_tokens) - hit.num_tokens, hit.num_tokens, hit) is not None
    assert pool.adopt_reservation("short", hit.num_tokens) is None
    pool.free("short")
    assert "long" in pool.reservations.live

    # an allocation storm: a request of other tokens takes every block it can
    other = [5] * (4 * (pool.num_free_blocks - 1))
    other_hashes = BlockHasher("sha256_cbor", H, NONE).extend(other)
    pool.add_request("storm", other, other_hashes)
    assert pool.allocate_slots("storm", len(other), 0, pool.get_computed_blocks("storm")) is not None
    pool.free("storm")
    check_invariants(pool)

    assert pool.find_longest_cache_hit(long_hashes, len(long_tokens)) == promised
    pool.add_request("long-req", long_tokens, long_hashes)
    got = pool.get_computed_blocks("long-req")
    assert got == promised
    assert pool.allocate_slots("long-req", len(long_tokens) - got.num_tokens, got.num_tokens, got) is not None
    adopted = pool.adopt_reservation("long-req", got.num_tokens)
    assert adopted is not None and adopted.reservation_id == "long"
    pool.free("long-req")
    counters = pool.reservations.counters
    assert (counters.adopted, counters.short_hits, counters.promised_tokens) == (1, 0, promised.num_tokens)
    assert not pool.reservations.live
    check_invariants(pool)
