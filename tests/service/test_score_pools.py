"""ScorePools over real gRPC: every score equals FindLongestCacheHit on that pool, for
pools of several layouts and hash settings, prompts with and without LoRA and salt;
the policy helper picks the best; scoring changes nothing; tenants score only pools
they may observe."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from durable_server import DurableServer
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import InvalidArgumentError, PermissionDeniedError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.routing import PoolRouter, choose_pool, hash_prompt, score_rank
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import PoolWorker
from tenancy import TENANTS, TOKENS, Raw, pool_toml

G = pb.KVCacheGroupSpec


def _config(groups: list[pb.KVCacheGroupSpec], algo: str = "sha256_cbor", seed: str = "0",
            caching: bool = True, eagle: bool = False, num_blocks: int = 40) -> pb.PoolConfig:  # fmt: skip
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=groups,
        hash_block_size=4,
        enable_caching=caching,
        use_eagle=eagle,
        max_model_len=256,
        hash_algo=algo if caching else "",
        hash_seed=seed if caching else "",
    )


LAYOUTS: dict[str, pb.PoolConfig] = {
    "full": _config([G(full=pb.FullAttentionSpec(block_size=4))]),
    "full-xx": _config([G(full=pb.FullAttentionSpec(block_size=4))], algo="xxhash_cbor", seed="7"),
    "hybrid": _config(
        [G(full=pb.FullAttentionSpec(block_size=4)), G(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=8))]
    ),
    "hybrid-8": _config(
        [G(full=pb.FullAttentionSpec(block_size=8)), G(sliding_window=pb.SlidingWindowSpec(block_size=8, sliding_window=16))],
        num_blocks=30,
    ),
    "chunked": _config(
        [G(full=pb.FullAttentionSpec(block_size=4)), G(chunked_local=pb.ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8))]
    ),
    "mamba": _config(
        [G(full=pb.FullAttentionSpec(block_size=4)), G(mamba=pb.MambaSpec(block_size=8, mamba_cache_mode="all"))]
    ),
    "eagle": _config([G(full=pb.FullAttentionSpec(block_size=4))], seed="3", eagle=True),
    "sliding": _config([G(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=12))], num_blocks=24),
    "off": _config([G(full=pb.FullAttentionSpec(block_size=4))], caching=False),
}  # fmt: skip


def _prompt(rnd: random.Random, prefixes: list[list[int]]) -> list[int]:
    return rnd.choice(prefixes) + [rnd.randrange(50) for _ in range(rnd.randint(1, 30))]


def _state(client: KVCoordClient, pools: list[str]) -> list[object]:
    out: list[object] = []
    for p in pools:
        out.append(
            client.inspect_pool(p, free_queue_limit=1000, all_requests=True, include_cached_blocks=True)
        )
        out.append(client.get_stats(p).prefix_cache_stats)
    return out


def test_every_score_equals_find_longest_cache_hit(make_server: Callable[..., InProcessServer]) -> None:
    """Ten pools (the default hybrid, full, hybrid, merged hashes, chunked, mamba, EAGLE, sliding only,
    another hash function and seed, caching off) under a random workload with shared
    prefixes and LoRA: each of 150 prompts is scored everywhere, each score (length and
    block ids) equals FindLongestCacheHit on that pool with the pool's own hashes, the
    order and choose_pool follow the policy, and no pool changes."""
    server = make_server()
    rnd = random.Random(5)
    prefixes = [[rnd.randrange(50) for _ in range(n)] for n in (8, 20, 33, 48)]
    with KVCoordClient(server.address, timeout=10) as client:
        for name, cfg in LAYOUTS.items():
            client.create_pool(name, cfg)
        configs = {p.name: p.config for p in client.list_pools().pools}  # with the default "p"
        workers = {name: PoolWorker(client, name, cfg, rnd) for name, cfg in configs.items()}
        router = PoolRouter(client)
        names = sorted(configs)
        scored_hits = set()
        for round_ in range(150):
            for w in workers.values():
                if rnd.random() < 0.5:
                    w.step(_prompt(rnd, prefixes), rnd.choice([None, None, "ad"]))
            tokens = _prompt(rnd, prefixes)
            lora = rnd.choice([None, None, "ad"])
            before = _state(client, names)
            response = router.score(tokens, lora_name=lora, include_block_ids=True)
            assert _state(client, names) == before, round_
            assert not response.unscored
            assert sorted(s.pool for s in response.scores) == names
            assert [score_rank(s) for s in response.scores] == sorted(score_rank(s) for s in response.scores)
            assert choose_pool(response) == response.scores[0]
            for s in response.scores:
                reference = client.find_longest_cache_hit(
                    s.pool, workers[s.pool].hashes(tokens, lora), len(tokens)
                )
                assert s.hit == reference.hit, (round_, s.pool)
                assert s.hit_tokens == reference.hit.num_tokens
                assert s.num_free_blocks == reference.num_free_blocks
                assert s.fence == reference.fence
                scored_hits.add((s.pool, s.hit_tokens > 0))
        # the workload made real hits in every caching pool (the comparison was not all zeros)
        assert {p for p, hit in scored_hits if hit} == set(names) - {"off"}


def test_candidates_settings_and_errors(make_server: Callable[..., InProcessServer]) -> None:
    """Candidates limit the answer; a pool whose settings no prompt has is unscored
    (NO_PROMPT) and a pool shorter than the prompt is TOO_LONG; a wrong hash count is
    INVALID_ARGUMENT naming the pool; without block ids the hit is left out; a
    PoolRouter whose pool list missed a new pool's settings reads it again."""
    server = make_server()
    with KVCoordClient(server.address, timeout=10) as client:
        client.create_pool("xx", LAYOUTS["full-xx"])
        short = pb.PoolConfig()
        short.CopyFrom(LAYOUTS["full"])
        short.max_model_len = 8
        client.create_pool("short", short)
        pools = {p.name: p for p in client.list_pools().pools}
        tokens = list(range(12))
        prompts = hash_prompt([pools["p"]], tokens)
        r = client.score_pools(12, prompts)
        assert [s.pool for s in r.scores] == ["p"]
        assert [(u.pool, u.reason) for u in r.unscored] == [("short", "TOO_LONG"), ("xx", "NO_PROMPT")]
        r = client.score_pools(12, hash_prompt(pools.values(), tokens), ["xx"])
        assert [s.pool for s in r.scores] == ["xx"] and not r.scores[0].HasField("hit")
        with pytest.raises(InvalidArgumentError, match="'p'"):
            client.score_pools(16, prompts, ["p"])
        # the router reads the pool list again when it missed a pool's settings
        router = PoolRouter(client)
        assert sorted(router.pools()) == ["p", "short", "xx"]
        client.create_pool("eagle", LAYOUTS["eagle"])
        r = router.score(tokens)
        assert sorted(s.pool for s in r.scores) == ["eagle", "p", "xx"]
        assert sorted(router.pools()) == ["eagle", "p", "short", "xx"]


def test_tenants_score_only_pools_they_observe(make_server: Callable[..., InProcessServer]) -> None:
    """A watcher (observe) scores a-* pools; a user (use only) is refused when naming
    one and scores nothing without candidates; another tenant sees only its own pools;
    an isolated tenant's score counts only its own cached blocks, as its
    FindLongestCacheHit does."""
    server = make_server(TENANTS + pool_toml("a-pool") + pool_toml("b-pool"))
    tokens = list(range(16))
    raw = Raw(server.address)
    try:
        admin = raw.ok(
            "Attach",
            pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"),
            TOKENS["admin"],
        )
        hashes = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(tokens)
        sync = pb.RequestSync(
            request_id="r", append_token_ids=tokens, append_block_hashes=hashes, new_request=True
        )
        raw.ok(
            "Allocate",
            pb.AllocateRequest(
                pool="a-pool", session_id=admin.session_id, op=pb.AllocateOp(request=sync, num_new_tokens=16)
            ),
            TOKENS["admin"],
        )
        prompt = pb.HashedPrompt(
            hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes
        )

        def score(caller: str, candidates: list[str]) -> tuple[grpc.StatusCode, object]:
            request = pb.ScorePoolsRequest(num_tokens=17, prompts=[prompt], candidate_pools=candidates)
            return raw.call("ScorePools", request, TOKENS[caller])

        def find(caller: str) -> int:
            request = pb.FindLongestCacheHitRequest(pool="a-pool", block_hashes=hashes, num_tokens=17)
            return int(raw.ok("FindLongestCacheHit", request, TOKENS[caller]).hit.num_tokens)

        code, answer = score("watcher", ["a-pool"])
        assert code == grpc.StatusCode.OK
        assert [s.pool for s in answer.scores] == ["a-pool"]  # type: ignore[attr-defined]
        # tenants' caches are isolated: the watcher's hit is its own (none), as is admin's
        assert answer.scores[0].hit_tokens == 0  # type: ignore[attr-defined]
        code, answer = score("admin", [])
        assert [(s.pool, s.hit_tokens) for s in answer.scores] == [("a-pool", find("admin"))]  # type: ignore[attr-defined]
        assert find("admin") == 16
        assert score("user", ["a-pool"])[0] == grpc.StatusCode.PERMISSION_DENIED
        code, answer = score("user", [])
        assert code == grpc.StatusCode.OK and not answer.scores and not answer.unscored  # type: ignore[attr-defined]
        code, answer = score("other", [])
        assert [s.pool for s in answer.scores] == ["b-pool"]  # type: ignore[attr-defined]
        assert score("other", ["a-pool", "b-pool"])[0] == grpc.StatusCode.PERMISSION_DENIED
    finally:
        raw.close()
    with KVCoordClient(server.address, timeout=10, token=TOKENS["user"]) as client:
        with pytest.raises(PermissionDeniedError):
            client.score_pools(17, [prompt], ["a-pool"])


def test_scores_stay_exact_through_every_change_of_the_maps(tmp_path: Path) -> None:
    """Nothing of a score outlives the call (docs/routing.md): in a journaled server
    process, after each change that drops or rebuilds cached blocks (an eviction storm,
    ResetPrefixCache, pools deleted and created again, a SIGKILL restart replaying the
    journal, a clean restart from its snapshot, a reservation expiring and its blocks
    then evicted), every score of prompts sharing the workload's prefixes equals
    FindLongestCacheHit on that pool, with block ids and without (the hit lengths of the
    server's cross-pool index, which must follow every one of these changes), and the
    scores moved (hits before, none after a reset or a re-create)."""
    toml = "".join(
        f'[[pools]]\nname = "{name}"\nnum_blocks = 40\nhash_block_size = 4\nhash_algo = "sha256_cbor"\n'
        f'hash_seed = "0"\nenable_caching = true\nmax_model_len = 256\n' + groups
        for name, groups in (
            ("full", '[[pools.groups]]\ntype = "full"\nblock_size = 4\n'),
            ("hybrid", '[[pools.groups]]\ntype = "full"\nblock_size = 4\n[[pools.groups]]\n'
                       'type = "sliding_window"\nblock_size = 4\nsliding_window = 8\n'),
        )
    )  # fmt: skip
    server = DurableServer(tmp_path, toml)
    server.start()
    rnd = random.Random(9)
    prefixes = [[rnd.randrange(50) for _ in range(n)] for n in (8, 20, 33)]
    prompts = [p + [rnd.randrange(50) for _ in range(5)] for p in prefixes]
    try:

        def check(client: KVCoordClient) -> int:
            """Every score against FindLongestCacheHit; the total hit tokens."""
            total = 0
            configs = {p.name: p.config for p in client.list_pools().pools}
            for tokens in prompts:
                response = client.score_pools(
                    len(tokens), hash_prompt(list(client.list_pools().pools), tokens), include_block_ids=True
                )
                # without block ids: the hit lengths of the server's cross-pool index
                lengths = client.score_pools(
                    len(tokens), hash_prompt(list(client.list_pools().pools), tokens)
                )
                assert [(s.pool, s.hit_tokens, s.num_free_blocks) for s in lengths.scores] == [
                    (s.pool, s.hit_tokens, s.num_free_blocks) for s in response.scores
                ]
                assert sorted(s.pool for s in response.scores) == sorted(configs)
                for s in response.scores:
                    cfg = configs[s.pool]
                    hashes = BlockHasher(cfg.hash_algo, 4, none_hash(cfg.hash_algo, cfg.hash_seed)).extend(
                        tokens
                    )
                    assert s.hit == client.find_longest_cache_hit(s.pool, hashes, len(tokens)).hit, s.pool
                    total += s.hit_tokens
            return total

        batches = iter(range(1, 1000))

        def workers_of(client: KVCoordClient) -> list[PoolWorker]:
            """A worker per pool, its request ids new (requests held across a restart keep theirs)."""
            out = [PoolWorker(client, p.name, p.config, rnd) for p in client.list_pools().pools]
            first = next(batches) * 100
            for w in out:
                w.n = first
            return out

        def fill(client: KVCoordClient, free: bool = True) -> list[PoolWorker]:
            workers = workers_of(client)
            for _ in range(6):
                for w in workers:
                    w.step(_prompt(rnd, prefixes), None)
            if free:
                for w in workers:
                    if w.live:
                        client.free(w.pool, w.live, session_id=w.sid)
                        w.live.clear()
            return workers

        def storm(client: KVCoordClient) -> None:
            for w in workers_of(client):
                for _ in range(8):
                    w.step([rnd.randrange(1000, 2000) for _ in range(60)], None)
                if w.live:
                    client.free(w.pool, w.live, session_id=w.sid)
                    w.live.clear()

        with KVCoordClient(server.address, timeout=10) as client:
            fill(client)
            assert check(client) > 0
            storm(client)
            check(client)
            fill(client)
            for name in ("full", "hybrid"):
                assert client.reset_prefix_cache(name).result
            assert check(client) == 0
            fill(client)
            assert check(client) > 0
            for name in ("full", "hybrid"):
                cfg = client.get_pool(name).pool.config
                client.delete_pool(name)
                client.create_pool(name, cfg)
            assert check(client) == 0  # the new pools have nothing (none of the old ones' keys)
            fill(client, free=False)  # requests still held at the kill
            before = check(client)
        server.kill()
        server.start()
        with KVCoordClient(server.address, timeout=10) as client:
            assert check(client) == before  # the journal replayed: the same maps, the same scores
            fill(client)
        server.stop()  # a clean stop writes the snapshot the next start loads
        server.start()
        with KVCoordClient(server.address, timeout=10) as client:
            assert check(client) > 0
            tokens = prompts[2]
            reserved = client.score_pools(
                len(tokens), hash_prompt(list(client.list_pools().pools), tokens), reserve_seconds=0.2
            )
            assert reserved.reservation.hit_tokens > 0
            deadline = time.monotonic() + 10
            while client.get_stats(reserved.reservation.pool).reservations.live:
                assert time.monotonic() < deadline, "the reservation did not expire"
                time.sleep(0.1)
            storm(client)
            check(client)
    finally:
        server.stop()
