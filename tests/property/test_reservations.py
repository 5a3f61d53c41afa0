"""Reservations in the engine: a reserved hit survives any allocation storm until it is
released or adopted, its references are counted like a request's, and releasing them
all leaves a sound pool."""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import check_invariants
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import KVCacheConfig, KVCachePool
from strategies import PREFIXES, H, configs
from test_lookup_and_lazy_blocks import drive

NONE = none_hash("sha256_cbor", "0")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.randoms(use_true_random=False), st.integers(10, 60))
def test_a_reserved_hit_survives_an_allocation_storm(
    config: KVCacheConfig, rnd: random.Random, steps: int
) -> None:
    """A random scheduler allocates, preempts and frees in a small pool (so cached
    blocks are evicted all the time) while prompts are reserved, adopted by requests
    and released at random: before every lookup each live reservation's prompt still
    hits at least what was reserved (every layout, EAGLE included), the pool's
    invariants hold with the reservations' references counted, an adopting request
    gets at least the reserved hit, and at the end releasing every reservation leaves
    every block free. (EvictBlocksOp, which drops a hash whoever holds the block, is
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
                # the oldest reservation of this prefix: the same hash at its hit's end
                oldest = next(
                    r
                    for r, (_, h, n) in live.items()
                    if h[n // H - 1 : n // H] == hashes[n // H - 1 : n // H]
                )
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
