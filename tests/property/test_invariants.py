"""Random workloads on random layouts keep every invariant of semantics.md §7."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import check_hit, check_invariants
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import CrossAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCachePool
from strategies import PREFIXES, H, configs

NONE = none_hash("sha256_cbor", "0")


@dataclass
class Req:
    hasher: BlockHasher
    computed: int = 0
    running: bool = False
    tokens: list[int] = field(default_factory=list)


class Scheduler:
    """A tiny vLLM-like scheduler driving one pool."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.pool = KVCachePool(config)
        self.reqs: dict[str, Req] = {}
        self.next_id = 0
        self.evicted = False
        self.cross = any(isinstance(g, CrossAttentionSpec) for g in config.groups)

    def add(self, prompt: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        h = BlockHasher("sha256_cbor", H, NONE)
        self.pool.add_request(rid, prompt, h.extend(prompt))
        self.reqs[rid] = Req(h, tokens=list(prompt))

    def step(self, rid: str, budget: int) -> None:
        r = self.reqs[rid]
        n = len(r.tokens)
        if not r.running:
            hit = self.pool.get_computed_blocks(rid)
            check_hit(self.pool, n, hit.block_ids, hit.num_tokens)
            num_new = min(n - hit.num_tokens, budget)
            # Invariant 11: a refusal changes nothing but skipped-block removal, which full
            # attention never does; so full-attention pools must be exactly unchanged.
            full_only = all(isinstance(g, FullAttentionSpec) for g in self.pool.config.groups)
            before = self.pool.snapshot() if full_only else None
            new = self.pool.allocate_slots(
                rid, num_new, hit.num_tokens, hit, num_encoder_tokens=12 if self.cross else 0
            )
            if new is None:
                if before is not None:
                    assert self.pool.snapshot() == before
                return
            r.running = True
            r.computed = hit.num_tokens + num_new
        else:
            num_new = min(n - r.computed, budget)
            if num_new == 0 or r.computed + num_new >= 96:
                return
            if self.pool.allocate_slots(rid, num_new) is None:
                return
            r.computed += num_new
        new_tokens = [r.computed % 5] if r.computed == n and n < 95 else []
        r.tokens += new_tokens
        self.pool.update_request(
            rid,
            num_computed_tokens=r.computed,
            append_token_ids=new_tokens,
            append_block_hashes=r.hasher.extend(new_tokens),
        )

    def preempt(self, rid: str) -> None:
        self.pool.preempt(rid)
        self.reqs[rid].running = False
        self.reqs[rid].computed = 0

    def free(self, rid: str) -> None:
        self.pool.free(rid)
        del self.reqs[rid]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.randoms(use_true_random=False), st.integers(10, 60))
def test_random_workloads_keep_invariants(config: KVCacheConfig, rnd: random.Random, steps: int) -> None:
    """Reference counts equal holders, the free queue is exactly the unheld blocks, the hash
    map is consistent, sharing only comes from the prefix cache, and everything is free at the end."""
    s = Scheduler(config)
    for _ in range(steps):
        if rnd.random() < 0.5 or not s.reqs:
            prefix = rnd.choice(PREFIXES)
            s.add((prefix + [rnd.randrange(4) for _ in range(rnd.randint(1, 24))])[:48])
        budget = rnd.choice([4, 7, 16, 64])
        for rid in sorted(s.reqs):
            roll = rnd.random()
            if roll < 0.06:
                s.free(rid)
            elif roll < 0.1 and s.reqs[rid].running:
                s.preempt(rid)
            else:
                s.step(rid, budget)
            check_invariants(s.pool, s.evicted)
        roll = rnd.random()
        if roll < 0.05:
            ids = [rnd.randrange(config.num_blocks) for _ in range(rnd.randint(1, 3))]
            s.pool.evict_blocks(ids)
            s.evicted = True
        elif roll < 0.1:
            held = any(any(lst) for r in s.reqs for lst in s.pool.get_block_ids(r))
            assert s.pool.reset_prefix_cache() == (not held)
        elif roll < 0.3:
            s.pool.take_events()
        check_invariants(s.pool, s.evicted)
    for rid in sorted(s.reqs):
        s.free(rid)
        check_invariants(s.pool, s.evicted)
    assert s.pool.num_free_blocks == config.num_blocks - 1
    assert s.pool.reset_prefix_cache() is True
    assert len(s.pool.block_pool.cached_block_hash_to_block) == 0
    check_invariants(s.pool)
