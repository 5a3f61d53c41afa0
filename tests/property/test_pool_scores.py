"""ScorePools without gRPC: every pool's score is the hit a request of that prompt gets
there (its own coordinator, every layout), best first, and scoring changes nothing."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.engine.hash_list import hashes_at_block_size
from kvcoord.service.errors import ServiceError
from kvcoord.service.pool_service import UNSCORED_NO_PROMPT, UNSCORED_TOO_LONG, Fence, Limits, PoolService
from kvcoord.service.scoring import ScoreIndex, score_pools
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock
from strategies import PREFIXES, H, configs
from test_lookup_and_lazy_blocks import drive

SETTINGS = ("sha256_cbor", H, "0")
NONE = none_hash("sha256_cbor", "0")
_ids = itertools.count()


def service(name: str, config: KVCacheConfig, settings: tuple[str, int, str] = SETTINGS) -> PoolService:
    return PoolService(
        name, config, settings, Fence("i", 1), Limits(), SessionTable(ManualClock(), 30.0, 60.0)
    )


def reference_hit(pool: KVCachePool, tokens: list[int], hashes: list[bytes]):  # type: ignore[no-untyped-def]
    """What a request with this prompt gets from vLLM's lookup (get_computed_blocks) in
    a copy of the pool: the hit a router is promised."""
    clone = copy.deepcopy(pool)
    rid = f"ref-{next(_ids)}"
    clone.add_request(rid, tokens, hashes)
    return clone.get_computed_blocks(rid)


def check_scores(pools: dict[str, PoolService], tokens: list[int], index: ScoreIndex | None = None) -> None:
    """Score ``tokens`` everywhere and compare each pool with its reference; with
    ``index`` (one kept across the pools' changes) also score the hit lengths through
    it, and check its bits are each watched pool's keys."""
    hashes = BlockHasher(*SETTINGS[:2], NONE).extend(tokens)
    before = {n: p.engine.snapshot() for n, p in pools.items()}
    counters = {n: repr(p.engine.lookup_counters) for n, p in pools.items()}
    result = score_pools(pools, lambda _: True, [], len(tokens), [(SETTINGS, hashes)])
    lengths = None
    if index is not None:
        lengths = score_pools(pools, lambda _: True, [], len(tokens), [(SETTINGS, hashes)], index=index)
        check_index(pools, index)
    assert {n: p.engine.snapshot() for n, p in pools.items()} == before
    assert {n: repr(p.engine.lookup_counters) for n, p in pools.items()} == counters
    assert not result.unscored
    assert sorted(s.pool for s in result.scores) == sorted(pools)
    ranks = [(-s.hit.num_tokens, -s.num_free_blocks, s.pool) for s in result.scores]
    assert ranks == sorted(ranks)
    for s in result.scores:
        engine = pools[s.pool].engine
        assert s.hit == reference_hit(engine, tokens, hashes), s.pool
        assert s.hit == engine.find_longest_cache_hit(hashes, len(tokens))
        assert (s.num_free_blocks, s.usage) == (engine.num_free_blocks, engine.usage)
        assert s.num_total_blocks == engine.config.num_blocks - 1
    if lengths is not None:
        assert not lengths.unscored
        # the same ranking: pools, hit lengths, free blocks, usage, in the same order
        assert [
            (s.pool, s.hit.num_tokens, s.num_free_blocks, s.usage, s.num_total_blocks) for s in lengths.scores
        ] == [
            (s.pool, s.hit.num_tokens, s.num_free_blocks, s.usage, s.num_total_blocks) for s in result.scores
        ]


def check_index(pools: dict[str, PoolService], index: ScoreIndex) -> None:
    """Every pool whose search starts with full attention is watched (it was just
    scored) and its bits are exactly the keys of that group's map."""
    for name, p in pools.items():
        first = p.engine.hits.first_full
        if first is None or not p.engine.config.enable_caching:
            assert index.keys_of(name) == set(), name
            continue
        live = p.engine.block_pool.cached_block_hash_to_block.first[first[0]]
        assert index.keys_of(name) == set(live), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(configs(), min_size=2, max_size=4), st.randoms(use_true_random=False), st.integers(8, 30))
def test_every_score_is_the_hit_a_request_gets(
    layouts: list[KVCacheConfig], rnd: random.Random, steps: int
) -> None:
    """Pools of random layouts (full, sliding window, chunked local, mamba, hybrids,
    EAGLE, caching off) driven by a random scheduler: before every lookup, the
    request's prompt and a few other prompts are scored in every pool; each score is
    get_computed_blocks' hit on a copy of that pool, the order is the policy's, and
    no pool changes (snapshot, counters)."""
    pools = {f"p{i}": service(f"p{i}", cfg) for i, cfg in enumerate(layouts)}
    names = list(pools)
    index = ScoreIndex()  # kept across every change the scheduler makes

    def probe(pool: KVCachePool, rid: str) -> None:
        check_scores(pools, list(pool.get_request(rid).all_token_ids), index)
        prompt = rnd.choice(PREFIXES) + [rnd.randrange(4) for _ in range(rnd.randint(1, 20))]
        check_scores(pools, prompt[:90], index)

    # Drive the pools one after another, each probing all of them, so every pool is
    # scored in many states (the others hold what their own runs cached).
    for name in names:
        drive(pools[name].engine, random.Random(rnd.random()), steps, probe)


def test_unscored_pools_and_refusals() -> None:
    """A pool whose max_model_len is shorter is TOO_LONG, one whose hash settings no
    prompt has is NO_PROMPT (a pool without caching needs no prompt); duplicates,
    unknown or unobservable candidates and wrong hashes are typed errors."""
    full = KVCacheConfig(num_blocks=16, groups=(FullAttentionSpec(4),), hash_block_size=4, max_model_len=64)
    pools = {
        "a": service("a", full),
        "short": service("short", KVCacheConfig(16, (FullAttentionSpec(4),), 4, max_model_len=8)),
        "xx": service("xx", full, ("xxhash", 4, "0")),
        "off": service("off", KVCacheConfig(16, (FullAttentionSpec(4),), 4, enable_caching=False)),
    }
    tokens = list(range(12))
    prompt = [(SETTINGS, BlockHasher("sha256_cbor", 4, NONE).extend(tokens))]
    r = score_pools(pools, lambda _: True, [], 12, prompt)
    assert [(u.pool, u.reason) for u in r.unscored] == [
        ("short", UNSCORED_TOO_LONG),
        ("xx", UNSCORED_NO_PROMPT),
    ]
    assert sorted(s.pool for s in r.scores) == ["a", "off"]
    r = score_pools(pools, lambda n: n != "a", [], 12, prompt)
    assert "a" not in {s.pool for s in r.scores} | {u.pool for u in r.unscored}
    cases = [
        (["a", "a"], 12, prompt, grpc.StatusCode.INVALID_ARGUMENT),
        (["hidden"], 12, prompt, grpc.StatusCode.PERMISSION_DENIED),
        (["nope"], 12, prompt, grpc.StatusCode.NOT_FOUND),
        (["a"], 0, prompt, grpc.StatusCode.INVALID_ARGUMENT),
        (["a"], 12, prompt * 2, grpc.StatusCode.INVALID_ARGUMENT),
        (["a"], 13, prompt, grpc.StatusCode.INVALID_ARGUMENT),  # 13 tokens: still 3 hashes, fine
        (["a"], 16, prompt, grpc.StatusCode.INVALID_ARGUMENT),  # 16 tokens need 4 hashes
    ]
    for candidates, n, prompts, code in cases:
        if n == 13:
            assert score_pools(pools, lambda _: True, candidates, n, prompts).scores[0].pool == "a"
            continue
        with pytest.raises(ServiceError) as info:
            score_pools(pools, lambda name: name != "hidden", candidates, n, prompts)
        assert info.value.code == code, (candidates, n)


TENANTS = ["", "t1", "t2", "t3"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(configs(), min_size=2, max_size=5), st.randoms(use_true_random=False))
def test_scores_per_tenant_with_each_pools_own_namespace_prefixes(
    layouts: list[KVCacheConfig], rnd: random.Random
) -> None:
    """One call scores one prompt in many pools: each pool's checks, namespaced keys
    and merged block-size views are derived once and shared between pools. Tenants
    cache prompts in each pool in a different order (so the same tenant has a
    different namespace prefix in each pool, and the same prefix names different
    tenants), filler requests evict, and every prompt scored as every tenant in one
    call is, in every pool, that tenant's get_computed_blocks hit (namespace
    included) and its own find_longest_cache_hit on a plain list; the hit lengths through
    a cross-pool index watching every pool from the start are the same."""
    pools = {
        f"p{i}": service(f"p{i}", dataclasses.replace(cfg, hash_length=32)) for i, cfg in enumerate(layouts)
    }

    def hashed(tokens: list[int]) -> list[bytes]:
        return BlockHasher(*SETTINGS[:2], NONE).extend(tokens)

    prompts = [p + [rnd.randrange(4) for _ in range(rnd.randint(1, 30))] for p in PREFIXES[1:]]
    index = ScoreIndex()  # watching every pool before the tenants cache anything
    first = prompts[0][:8]
    score_pools(pools, lambda _: True, [], len(first), [(SETTINGS, hashed(first))], index=index)
    for name, p in pools.items():
        engine = p.engine
        for step in range(rnd.randint(2, 12)):
            tenant = rnd.choice(TENANTS)
            tokens = rnd.choice(prompts)
            if rnd.random() < 0.3:  # a filler, evicting cached blocks
                tokens = [rnd.randrange(1000, 2000) for _ in range(rnd.randint(4, 40))]
            rid = f"{name}-{step}"
            engine.add_request(rid, tokens, hashed(tokens), cache_namespace=p.cache_namespace(tenant))
            engine.allocate_slots_with_lookup(rid, len(tokens))
            engine.free(rid)
    for tokens in prompts + [prompts[0][:3]]:
        hashes = hashed(tokens)
        for tenant in TENANTS:
            result = score_pools(pools, lambda _: True, [], len(tokens), [(SETTINGS, hashes)], tenant)
            assert sorted(s.pool for s in result.scores) == sorted(pools)
            for s in result.scores:
                engine = pools[s.pool].engine
                namespace = pools[s.pool].cache_namespace(tenant)
                clone = copy.deepcopy(engine)
                clone.add_request("ref", tokens, list(hashes), cache_namespace=namespace)
                assert s.hit == clone.get_computed_blocks("ref"), (s.pool, tenant)
                assert s.hit == engine.find_longest_cache_hit(list(hashes), len(tokens), namespace)
            lengths = score_pools(
                pools, lambda _: True, [], len(tokens), [(SETTINGS, hashes)], tenant, index=index
            )
            assert [(s.pool, s.hit.num_tokens) for s in lengths.scores] == [
                (s.pool, s.hit.num_tokens) for s in result.scores
            ], tenant
    check_index(pools, index)


def test_wrong_hashes_are_refused_by_every_pool_sharing_the_prompt() -> None:
    """The check of a shared prompt runs once per distinct pool rule and is kept: a
    pool whose rule refuses the hashes refuses them whichever pool was scored first,
    and one whose rule accepts them scores them."""

    def cfg(length: int | None, max_model_len: int = 64) -> KVCacheConfig:
        return KVCacheConfig(16, (FullAttentionSpec(4),), 4, max_model_len=max_model_len, hash_length=length)

    tokens = list(range(12))
    hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)  # 32 bytes each
    for order in (["a", "b"], ["b", "a"]):
        pools = {"a": service("a", cfg(32)), "b": service("b", cfg(16))}
        with pytest.raises(ServiceError) as info:
            score_pools(pools, lambda _: True, order, 12, [(SETTINGS, hashes)])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "pool 'b'" in str(info.value)
        assert score_pools(pools, lambda _: True, ["a"], 12, [(SETTINGS, hashes)]).scores[0].pool == "a"


def test_first_block_probe_with_coarser_groups_and_evicted_blocks() -> None:
    """A pool whose search starts with full attention answers no hit as soon as the
    prompt's first block is missing there (read at that group's own block size, which
    may be coarser than the hashes); a pool starting with another type searches on.
    Scores equal get_computed_blocks' hit with the prefix cached, with its first block
    evicted from each group in turn, and with a middle block evicted."""
    n = 64
    layouts = {
        "full": (FullAttentionSpec(4),),
        "full8+swa": (FullAttentionSpec(8), SlidingWindowSpec(8, 16)),
        "full+swa8": (FullAttentionSpec(4), SlidingWindowSpec(8, 32)),
        "swa": (SlidingWindowSpec(4, 8),),
        "swa+full8": (SlidingWindowSpec(8, 16), FullAttentionSpec(8)),
    }
    tokens = list(range(500, 540))
    hashes = BlockHasher(*SETTINGS[:2], NONE).extend(tokens)
    for position in ("first", "middle"):
        for group in (0, 1):
            pools = {
                name: service(name, KVCacheConfig(n, groups, H, max_model_len=96))
                for name, groups in layouts.items()
            }
            for p in pools.values():
                p.engine.add_request("fill", tokens, hashes)
                p.engine.allocate_slots_with_lookup("fill", len(tokens))
                p.engine.free("fill")
            check_scores(pools, tokens + [1])  # the whole prefix cached
            for p in pools.values():
                groups = p.engine.config.groups
                g = min(group, len(groups) - 1)
                view = hashes_at_block_size(hashes, H, groups[g].block_size)
                key = view[0] if position == "first" else view[len(view) // 2]
                block = p.engine.block_pool.cached_block_hash_to_block.first[g].get(key)
                assert block, (p.name, g, position)
                p.engine.evict_blocks([block])
            check_scores(pools, tokens + [1])
            check_scores(pools, tokens[:20])


def test_the_index_follows_every_change_of_the_maps() -> None:
    """One ScoreIndex kept across every kind of change a pool's map sees, in pools whose
    search starts with full attention (one group, EAGLE, full + sliding window, and
    full attention of blocks twice the hash block size beside a sliding window) and one
    whose search does not (sliding window alone): caching and eviction by a scheduler, eviction of named blocks, a prefix-cache
    reset, the engine replaced from its exported state (a restore, an adoption), and a
    pool created again under the same name without the index being told. After each,
    every hit length through the index equals the pool's own search, and each watched
    pool's bits are exactly its map's keys."""
    layouts = {
        "full": KVCacheConfig(
            num_blocks=24, groups=(FullAttentionSpec(H),), hash_block_size=H, max_model_len=96
        ),
        "eagle": KVCacheConfig(24, (FullAttentionSpec(H),), H, max_model_len=96, use_eagle=True),
        "coarse": KVCacheConfig(
            24, (FullAttentionSpec(2 * H), SlidingWindowSpec(H, 4 * H)), H, max_model_len=96
        ),
        "hybrid": KVCacheConfig(24, (FullAttentionSpec(H), SlidingWindowSpec(H, 2 * H)), H, max_model_len=96),
        "window": KVCacheConfig(24, (SlidingWindowSpec(H, 2 * H),), H, max_model_len=96),
    }
    pools = {name: service(name, cfg) for name, cfg in layouts.items()}
    index = ScoreIndex()
    rnd = random.Random(5)
    prompts = [(p + [rnd.randrange(4) for _ in range(9)])[:60] for p in PREFIXES]

    def check_all() -> None:
        for tokens in prompts:
            check_scores(pools, tokens, index)

    def driven(seed: int) -> int:
        for p in pools.values():
            drive(p.engine, random.Random(seed), 25)
        check_all()
        return sum(len(index.keys_of(n)) for n in pools)

    assert driven(1) > 0
    for p in pools.values():  # named blocks evicted (half of each map's blocks)
        p.engine.evict_blocks(p.engine.block_pool.cached_block_ids()[::2])
    check_all()
    driven(2)
    for name, p in pools.items():  # a reset needs every request gone
        for rid in list(p.engine.requests):
            p.engine.free(rid)
        assert p.reset_prefix_cache(), name
    check_all()
    assert sum(len(index.keys_of(n)) for n in pools) == 0
    driven(3)
    for p in pools.values():  # a new engine with the same state
        p.import_state(p.export_state())
    check_all()
    assert driven(4) > 0
    for name, cfg in layouts.items():  # a new pool under the same name
        pools[name] = service(name, cfg)
    check_all()
    assert sum(len(index.keys_of(n)) for n in pools) == 0
    driven(5)
    index.forget("full")  # a registry drops a deleted pool's bits
    assert index.keys_of("full") == set()
    check_all()
