"""ScorePools on vllm-0.33 pools, without gRPC: in every layout vLLM 0.33.0 was
recorded in (the conformance traces the profile accepts), at every lookup of the
trace the request's prompt and prefixes of it are scored; each score is the hit a
request of that prompt gets (get_computed_blocks on a copy of the pool) and
FindLongestCacheHit's, through the cross-pool index too, and scoring changes nothing.

With block ids a vllm-0.33 pool is scored by its own search (PoolService.score: the
engine's find_longest_cache_hit, the very call FindLongestCacheHit makes); for hit
lengths alone through the index's walk (one-group pools by the walk alone, hybrids by
their own search unless the first full-attention group's run is empty). These tests
hold both answers to the reference lookup and check the index's bits are each watched
pool's live keys.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
from kvcoord.conformance import LocalTarget, load_trace, replay
from kvcoord.conformance.trace import config_from_trace
from kvcoord.engine import CacheHit, ConfigError, KVCachePool
from kvcoord.engine.profiles import VLLM_033
from kvcoord.service.pool_service import Fence, Limits, PoolService
from kvcoord.service.scoring import ScoreIndex, score_pools
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock

DATA = Path(__file__).parent.parent / "conformance" / "data-vllm-0.33"
TRACES = {p.stem: p for p in sorted(DATA.glob("*.jsonl"))}
#: layouts the vllm-0.33 profile refuses today (the pool cannot be created, so there
#: is nothing to score); any other trace's layout must be scored below
REFUSED = {"hybrid_full32_mamba32_align": "mamba"}


def reference_hit(pool: KVCachePool, tokens: list[int], hashes: list[bytes]) -> CacheHit:
    """What a new request with this prompt gets from the lookup, in a copy of the pool."""
    clone = copy.deepcopy(pool)
    clone.add_request("score-reference", tokens, hashes)
    return clone.get_computed_blocks("score-reference")


class ScoringTarget(LocalTarget):
    """A trace's pool inside a PoolService; before each lookup of the trace, the
    request's prompt and prefixes of it are scored and checked."""

    def __init__(self, rnd: random.Random) -> None:
        super().__init__()
        self.rnd = rnd
        self.index = ScoreIndex()  # kept across the whole trace
        self.service: PoolService | None = None
        self.probes = 0
        self.hits = 0

    def open(self, trace_config: dict[str, Any]) -> None:
        config = config_from_trace(trace_config)
        assert config.profile == VLLM_033
        settings = (
            trace_config.get("hash_algo") or "",
            config.hash_block_size,
            trace_config.get("hash_seed") or "",
        )
        self.service = PoolService(
            "p33", config, settings, Fence("i", 1), Limits(), SessionTable(ManualClock(), 30.0, 60.0)
        )
        self.pool = self.service.engine

    def get_computed_blocks(self, rid: str) -> tuple[list[list[int]], int]:
        request = self._p().get_request(rid)
        tokens, hashes = list(request.all_token_ids), list(request.block_hashes)
        self.check(tokens, hashes, deep=True)
        # prefixes of the prompt: shorter prompts sharing its cached blocks
        lookahead = self._p().config.num_hash_lookahead_tokens
        size = self._p().config.hash_block_size
        for n in {self.rnd.randint(1, len(tokens)), max(1, len(tokens) - self.rnd.randint(1, 2 * size))}:
            self.check(tokens[:n], hashes[: max(n - lookahead, 0) // size] if hashes else [], deep=False)
        return super().get_computed_blocks(rid)

    def check(self, tokens: list[int], hashes: list[bytes], deep: bool) -> None:
        service = self.service
        assert service is not None
        engine = service.engine
        pools = {"p33": service}
        before = engine.snapshot() if deep else None
        prompt = [(service.score_settings, hashes)]
        scores = score_pools(pools, lambda _: True, [], len(tokens), prompt)
        lengths = score_pools(pools, lambda _: True, [], len(tokens), prompt, index=self.index)
        assert not scores.unscored and not lengths.unscored
        (score,) = scores.scores
        (length,) = lengths.scores
        expected = engine.find_longest_cache_hit(hashes, len(tokens))
        assert score.hit == expected
        assert length.hit.num_tokens == expected.num_tokens
        assert (score.num_free_blocks, score.usage) == (engine.num_free_blocks, engine.usage)
        if deep:
            assert score.hit == reference_hit(engine, tokens, hashes)
            assert engine.snapshot() == before  # scoring changed nothing
        # the index watches every pool whose search starts with full attention: its
        # bits are exactly that group's live keys (none without caching)
        first = engine.hits.first_full if engine.config.enable_caching else None
        live = set() if first is None else set(engine.block_pool.cached_block_hash_to_block.first[first[0]])
        assert self.index.keys_of("p33") == live
        self.probes += 1
        self.hits += expected.num_tokens > 0


@pytest.mark.parametrize("name", sorted(TRACES))
def test_033_scores_are_the_hit_a_request_gets_in_every_recorded_layout(name: str) -> None:
    """Each accepted 0.33 layout (unitary, hybrids with sliding windows of several
    sizes, chunked local, two full groups, EAGLE look-ahead hashes, LoRA and salts,
    a KV connector, caching off) is scored at every lookup of its trace, and the
    trace itself still replays exactly (the probes changed nothing vLLM would see)."""
    trace = load_trace(TRACES[name])
    try:
        config_from_trace(trace.config)
    except ConfigError as exc:
        assert name in REFUSED, f"{name}: the vllm-0.33 profile refuses it: {exc}"
        assert REFUSED[name] in str(exc)
        return
    target = ScoringTarget(random.Random(name))
    result = replay(trace, target)
    assert result.passed, result.mismatch
    assert target.probes > 100
    if trace.config.get("enable_caching"):
        assert target.hits > 10, "the trace's lookups found hits (the comparison was not all zeros)"
