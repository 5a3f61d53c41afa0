"""Reservations in the engine: a reserved hit survives any allocation storm until it is
released or adopted, its references are counted like a request's, and releasing them
all leaves a sound pool."""

from __future__ import annotations

import dataclasses
import itertools
import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from invariants import check_invariants
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool
from kvcoord.engine.managers.full_attention import FullAttentionManager
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
        check_common_prefixes(pool)

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


def shared_by_every_holder(pool: KVCachePool, request_id: str) -> tuple[int, ...]:
    """Per group, the request's leading blocks held by every request and by every
    reservation (each one as a request holding its blocks would): vLLM's definition of
    the common prefix, counted from the tables, not from reference counts."""
    out = []
    for g, m in enumerate(pool.managers):
        others = [{b.block_id for b in blocks} for r, blocks in m.req_to_blocks.items() if r != request_id]
        others += [set(r.held[g]) for r in pool.reservations.live.values()]
        n = 0
        for b in m.req_to_blocks[request_id]:
            if not all(b.block_id in held for held in others):
                break
            n += 1
        out.append(n)
    return tuple(out)


def check_common_prefixes(pool: KVCachePool) -> None:
    """Every request holding blocks: ``get_num_common_prefix_blocks`` never counts a block
    some holder lacks (vLLM's cascade attention would read it for every request), and
    in a full-attention group of a caching pool (vLLM answers zeros without caching)
    it counts each block every holder has."""
    tables = pool.managers[0].req_to_blocks if pool.managers else {}
    for rid in [r for r in tables if all(r in m.req_to_blocks for m in pool.managers)]:
        told = pool.get_num_common_prefix_blocks(rid)
        shared = shared_by_every_holder(pool, rid)
        for g, m in enumerate(pool.managers):
            assert told[g] <= shared[g], (rid, g, told, shared)
            if (
                isinstance(m, FullAttentionManager)
                and pool.config.enable_caching
                and not pool.rules.common_prefix_zeros
            ):
                assert told[g] == shared[g], (rid, g, told, shared)


def test_a_reserved_hit_is_not_a_common_prefix_of_requests_that_lack_it() -> None:
    """A request A holds a cached prompt's blocks, B holds others; a router reserves A's
    prompt. The reservation holds A's blocks as an extra request would, so no block is
    common to every holder: A's common prefix stays 0 (was 2: the reservation's
    reference made each of A's blocks' count equal the number of requests, and vLLM's
    cascade attention would have read A's prefix for B too)."""
    pool = KVCachePool(dataclasses.replace(EAGLE_15, use_eagle=False, num_blocks=20))
    a_tokens, b_tokens = list(range(100, 109)), list(range(200, 209))
    a_hashes = BlockHasher("sha256_cbor", H, NONE).extend(a_tokens)
    for rid, tokens in (("A", a_tokens), ("B", b_tokens)):
        pool.add_request(rid, tokens, BlockHasher("sha256_cbor", H, NONE).extend(tokens))
        assert pool.allocate_slots(rid, len(tokens), 0, pool.get_computed_blocks(rid)) is not None
    assert pool.get_num_common_prefix_blocks("A") == (0,)
    assert pool.reserve("res", a_hashes, len(a_tokens)).num_tokens == 8
    assert pool.get_num_common_prefix_blocks("A") == (0,)
    assert pool.get_num_common_prefix_blocks("B") == (0,)
    check_common_prefixes(pool)
    pool.free("B")  # A alone with the reservation: both hold A's first two blocks
    assert pool.get_num_common_prefix_blocks("A") == shared_by_every_holder(pool, "A") == (2,)
    assert pool.release_reservation("res")
    assert pool.get_num_common_prefix_blocks("A") == (3,)  # A alone: every block of its own


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


def test_an_abandoned_request_leaves_no_hit_on_blocks_only_a_reservation_shares() -> None:
    """A request's allocation cached its prompt's blocks before its worker computed them;
    a router reserved that prompt's hit; the worker's session ended holding the request
    (free_abandoned: its KV may never have been written). The reservation is no reader
    of those blocks: their entries are dropped as if only the request held them, so the
    prompt no longer hits them and the request adopting the reservation computes them
    (was: the reservation kept the 8-token hit alive, promised to the next request of
    the prompt, over KV nobody wrote). With ``drop_reserved=False`` (a journal written
    before the rule replays so) the entries stay, as that server kept them."""
    config = dataclasses.replace(EAGLE_15, use_eagle=False, num_blocks=20)
    tokens = list(range(100, 109))
    hashes = BlockHasher("sha256_cbor", H, NONE).extend(tokens)
    for drop_reserved, left in ((True, 0), (False, 8)):
        pool = KVCachePool(config)
        pool.add_request("A", tokens, hashes)
        assert pool.allocate_slots("A", len(tokens), 0, pool.get_computed_blocks("A")) is not None
        assert pool.reserve("res", hashes, len(tokens)).num_tokens == 8
        free = pool.num_free_blocks
        pool.free_abandoned("A", drop_reserved)
        assert pool.find_longest_cache_hit(hashes, len(tokens)).num_tokens == left
        assert pool.num_free_blocks == free + 1  # (the reservation still holds the hit's 2 blocks)
        check_invariants(pool)
        pool.add_request("A2", tokens, hashes)
        hit = pool.get_computed_blocks("A2")
        assert hit.num_tokens == left
        assert pool.allocate_slots("A2", len(tokens) - hit.num_tokens, hit.num_tokens, hit) is not None
        assert pool.adopt_reservation("A2", hit.num_tokens) is not None
        assert pool.reservations.counters.short_hits == (1 if drop_reserved else 0)
        check_invariants(pool)


def test_an_abandoned_request_keeps_the_entries_another_request_reads() -> None:
    """The rule above stops at readers: a block the abandoned request and a live request
    hold (with or without a reservation) keeps its entry, as before (that request hit
    it and reads it)."""
    config = dataclasses.replace(EAGLE_15, use_eagle=False, num_blocks=20)
    tokens = list(range(100, 109))
    hashes = BlockHasher("sha256_cbor", H, NONE).extend(tokens)
    pool = KVCachePool(config)
    for rid in ("A", "B"):
        pool.add_request(rid, tokens, hashes)
        hit = pool.get_computed_blocks(rid)
        assert pool.allocate_slots(rid, len(tokens) - hit.num_tokens, hit.num_tokens, hit) is not None
    assert pool.reserve("res", hashes, len(tokens)).num_tokens == 8
    pool.free_abandoned("A")
    assert pool.find_longest_cache_hit(hashes, len(tokens)).num_tokens == 8  # B's
    check_invariants(pool)
