"""ScorePools on vllm-0.33 pools over real gRPC, as a router calls it (PoolRouter: the
prompt hashed by the client library for each pool's settings and profile): in every
layout vLLM 0.33.0 was recorded in, at every lookup of its trace, the router's score
of the request's prompt equals FindLongestCacheHit with the hashes vLLM computed;
a 0.16 pool and a 0.33 pool with the same hash settings are each scored with their
own release's hashes."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import InvalidArgumentError
from kvcoord.client.hashing import block_hasher, none_hash
from kvcoord.client.routing import PoolRouter, hash_prompt
from kvcoord.conformance import load_trace, replay
from kvcoord.conformance.remote import RemoteTarget
from kvcoord.conformance.trace import config_from_trace
from kvcoord.engine import ConfigError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb

DATA = Path(__file__).parent.parent / "conformance" / "data-vllm-0.33"
TRACES = {p.stem: p for p in sorted(DATA.glob("*.jsonl"))}
#: layouts the vllm-0.33 profile refuses today (see tests/property/test_pool_scores_033.py)
REFUSED = {"hybrid_full32_mamba32_align": "mamba"}


class RoutedTarget(RemoteTarget):
    """Replays a trace on a server; before each lookup a router scores the request's
    prompt (its tokens, LoRA name and path, cache salt) in the trace's pool."""

    def __init__(self, address: str, lora_paths: dict[str, str]) -> None:
        super().__init__(address)
        self.router = PoolRouter(self.client)
        self.lora_paths = lora_paths
        self.probes = 0
        self.hits = 0

    def get_computed_blocks(self, rid: str) -> tuple[list[list[int]], int]:
        p = self.prompts[rid]  # the request's prompt as the trace gave it (RemoteTarget)
        tokens, hashes, lora, salt = p.tokens, p.hashes, p.lora, p.cache_salt
        named = {"lora_name": lora.name, "lora_path": self.lora_paths[lora.name]} if lora else {}
        info = self.router.pools()[self.pool]
        if info.config.enable_caching:
            # the client library hashes the prompt as vLLM 0.33 did for this request
            (prompt,) = hash_prompt([info], tokens, cache_salt=salt, **named)  # type: ignore[arg-type]
            assert list(prompt.block_hashes) == hashes
        scored = self.router.score(tokens, [self.pool], cache_salt=salt, include_block_ids=True, **named)  # type: ignore[arg-type]
        lengths = self.router.score(tokens, [self.pool], cache_salt=salt, **named)  # type: ignore[arg-type]
        reference = self.client.find_longest_cache_hit(self.pool, hashes, len(tokens))
        assert not scored.unscored and not lengths.unscored
        assert scored.scores[0].hit == reference.hit
        assert scored.scores[0].hit_tokens == lengths.scores[0].hit_tokens == reference.hit.num_tokens
        assert scored.scores[0].num_free_blocks == reference.num_free_blocks
        self.probes += 1
        self.hits += reference.hit.num_tokens > 0
        return super().get_computed_blocks(rid)


def _lora_paths(path: Path) -> dict[str, str]:
    paths = {}
    for line in path.read_text().splitlines()[1:]:
        lora = json.loads(line).get("lora")
        if lora:
            paths[lora["name"]] = lora["path"]
    return paths


@pytest.mark.parametrize("name", sorted(TRACES))
def test_033_router_scores_equal_find_longest_cache_hit_over_grpc(
    name: str, make_server: Callable[..., InProcessServer]
) -> None:
    """Every accepted 0.33 layout's trace replayed over gRPC, the router scoring each
    lookup's prompt first (with block ids, and lengths alone through the index path):
    each score is FindLongestCacheHit's answer, and the trace still replays exactly."""
    trace = load_trace(TRACES[name])
    try:
        config_from_trace(trace.config)
    except ConfigError as exc:
        assert REFUSED.get(name, "?") in str(exc), f"{name}: the vllm-0.33 profile refuses it: {exc}"
        return
    server = make_server("")
    target = RoutedTarget(server.address, _lora_paths(TRACES[name]))
    result = replay(trace, target)
    assert result.passed, result.mismatch
    assert target.probes >= 30
    if trace.config.get("enable_caching"):
        assert target.hits > 10, "the trace's lookups found hits (the comparison was not all zeros)"


def _pool(profile: str) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=40, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))], hash_block_size=4,
        enable_caching=True, max_model_len=256, hash_algo="sha256_cbor", hash_seed="0", profile=profile,
    )  # fmt: skip


def test_a_016_and_a_033_pool_with_the_same_settings_each_get_their_own_hashes(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Two pools hashing with the same function, block size and seed, one per profile,
    both caching LoRA prompts: the router hashes the prompt once per profile and each
    pool's score equals FindLongestCacheHit with its own release's hashes (0.33's
    tagged LoRA key with its path). A prompt sent without a profile (0.16's hashes)
    leaves the 0.33 pool unscored instead of scoring it with the wrong hashes; an
    unknown profile or look-ahead on a 0.16 prompt is INVALID_ARGUMENT."""
    server = make_server("")
    rnd = random.Random(3)
    with KVCoordClient(server.address, timeout=10) as client:
        for profile in ("vllm-0.16", "vllm-0.33"):
            client.create_pool(profile, _pool(profile))

        def hashes(profile: str, tokens: list[int]) -> list[bytes]:
            none = none_hash("sha256_cbor", "0", profile=profile)
            return block_hasher(profile, "sha256_cbor", 4, none, lora_name="ad", lora_path="loras/ad").extend(
                tokens
            )

        for profile in ("vllm-0.16", "vllm-0.33"):
            att = client.attach(profile, "sha256_cbor", 4, "0", profile=profile)
            for i in range(6):
                tokens = [rnd.randrange(50) for _ in range(rnd.randint(10, 40))]
                sync = pb.RequestSync(request_id=f"r{i}", append_token_ids=tokens, append_block_hashes=hashes(profile, tokens),
                                      new_request=True, lora=pb.LoRA(adapter_id=1, name="ad"))  # fmt: skip
                op = pb.AllocateOp(request=sync, num_new_tokens=len(tokens), lookup=True)
                client.step(profile, [pb.Operation(allocate=op)], att.session_id, fence=att.fence)
                client.step(
                    profile,
                    [pb.Operation(free=pb.FreeOp(request_id=f"r{i}"))],
                    att.session_id,
                    fence=att.fence,
                )
                prompt = tokens + [rnd.randrange(50) for _ in range(3)]
                router = PoolRouter(client)
                response = router.score(prompt, lora_name="ad", lora_path="loras/ad", include_block_ids=True)
                assert not response.unscored
                for s in response.scores:
                    reference = client.find_longest_cache_hit(s.pool, hashes(s.pool, prompt), len(prompt))
                    assert s.hit == reference.hit, (profile, i, s.pool)
                assert {s.pool: s.hit_tokens for s in response.scores}[profile] >= 4 * (len(tokens) // 4 - 1)
        prompt = list(range(20))
        as_016 = pb.HashedPrompt(hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0",
                                 block_hashes=hashes("vllm-0.16", prompt))  # fmt: skip
        response = client.score_pools(len(prompt), [as_016])
        assert [s.pool for s in response.scores] == ["vllm-0.16"]
        assert [(u.pool, u.reason) for u in response.unscored] == [("vllm-0.33", "NO_PROMPT")]
        for wrong in (pb.HashedPrompt(profile="vllm-9"), pb.HashedPrompt(num_hash_lookahead_tokens=1)):
            with pytest.raises(InvalidArgumentError):
                client.score_pools(len(prompt), [wrong])
