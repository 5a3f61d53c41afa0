"""The read-only lookup equals get_computed_blocks and changes nothing; a pool whose
blocks are created lazily answers exactly like one whose blocks all exist up front."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import CrossAttentionSpec, KVCacheConfig, KVCachePool
from strategies import PREFIXES, H, configs

NONE = none_hash("sha256_cbor", "0")


def drive(
    pool: KVCachePool, rnd: random.Random, steps: int, probe: Any = None, snapshots: bool = False
) -> list[Any]:
    """A small random scheduler (lookups, chunked allocation, decode, preemption, frees,
    evictions, resets); returns every answer it got (and a snapshot per step with
    ``snapshots``). ``probe(pool, rid)`` runs before each lookup."""
    cfg = pool.config
    cross = any(isinstance(g, CrossAttentionSpec) for g in cfg.groups)
    hashers: dict[str, BlockHasher] = {}
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    running: set[str] = set()
    out: list[Any] = []
    nid = 0
    for _ in range(steps):
        if rnd.random() < 0.5 or not tokens:
            rid = f"r{nid}"
            nid += 1
            prompt = (rnd.choice(PREFIXES) + [rnd.randrange(4) for _ in range(rnd.randint(1, 24))])[:48]
            hashers[rid] = BlockHasher("sha256_cbor", H, NONE)
            pool.add_request(rid, prompt, hashers[rid].extend(prompt))
            tokens[rid], computed[rid] = list(prompt), 0
        budget = rnd.choice([4, 7, 16, 64])
        for rid in sorted(tokens):
            roll = rnd.random()
            if roll < 0.06:
                pool.free(rid)
                out.append(("free", rid, pool.num_free_blocks))
                del tokens[rid], computed[rid]
                running.discard(rid)
                continue
            if roll < 0.1 and rid in running:
                pool.preempt(rid)
                running.discard(rid)
                computed[rid] = 0
                out.append(("preempt", rid, pool.free_queue_head(8)))
                continue
            n = len(tokens[rid])
            if rid not in running:
                if probe is not None:
                    probe(pool, rid)
                hit = pool.get_computed_blocks(rid)
                num_new = min(n - hit.num_tokens, budget)
                new = pool.allocate_slots(
                    rid, num_new, hit.num_tokens, hit, num_encoder_tokens=12 if cross else 0
                )
                out.append(("admit", rid, hit, new))
                if new is None:
                    continue
                running.add(rid)
                computed[rid] = hit.num_tokens + num_new
            else:
                num_new = min(n - computed[rid], budget)
                if num_new == 0 or computed[rid] + num_new >= 96:
                    continue
                new = pool.allocate_slots(rid, num_new)
                out.append(("alloc", rid, new))
                if new is None:
                    continue
                computed[rid] += num_new
            appended = [computed[rid] % 5] if computed[rid] == n and n < 95 else []
            tokens[rid] += appended
            pool.update_request(
                rid,
                num_computed_tokens=computed[rid],
                append_token_ids=appended,
                append_block_hashes=hashers[rid].extend(appended),
            )
        roll = rnd.random()
        if roll < 0.05:
            pool.evict_blocks([rnd.randrange(cfg.num_blocks) for _ in range(rnd.randint(1, 3))])
        elif roll < 0.1:
            out.append(("reset", pool.reset_prefix_cache()))
        elif roll < 0.3:
            out.append(("events", pool.take_events()))
        out.append(
            ("state", pool.num_free_blocks, pool.usage, pool.free_queue_head(5), pool.cached_block_ids())
        )
    for rid in sorted(tokens):
        pool.free(rid)
    out.append(("end", pool.free_queue_head(), pool.make_prefix_cache_stats()))
    return out


def _counters(pool: KVCachePool) -> Any:
    c = pool.lookup_counters
    return dataclasses.replace(c, group_hit_tokens=list(c.group_hit_tokens))


def _probe(pool: KVCachePool, rid: str) -> None:
    """find_longest_cache_hit on this request's hashes changes nothing and equals the
    hit get_computed_blocks is about to return."""
    req = pool.get_request(rid)
    before, counters = pool.snapshot(), _counters(pool)
    ro = pool.find_longest_cache_hit(req.block_hashes, req.num_tokens)
    assert pool.snapshot() == before
    assert _counters(pool) == counters
    again = pool.find_longest_cache_hit(list(req.block_hashes), req.num_tokens)
    assert again == ro
    assert pool.get_computed_blocks(rid) == ro
    # also a prefix of the request, as a worker might ask about a shorter prompt
    n = max(1, req.num_tokens // 2)
    pool.find_longest_cache_hit(req.block_hashes[: n // pool.hash_block_size], n)
    assert pool.snapshot().free_queue == before.free_queue


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.randoms(use_true_random=False), st.integers(10, 50))
def test_read_only_lookup_equals_get_computed_blocks(config: KVCacheConfig, rnd: random.Random,
                                                     steps: int) -> None:  # fmt: skip
    """On random pool states, find_longest_cache_hit gives get_computed_blocks' hit and
    leaves the snapshot (free queue, ref counts, hashes, requests, events, stats) and the
    lifetime counters identical."""
    drive(KVCachePool(config), rnd, steps, _probe)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.integers(0, 2**32 - 1), st.integers(10, 50))
def test_lazy_blocks_answer_like_eager_blocks(config: KVCacheConfig, seed: int, steps: int) -> None:
    """Creating blocks on first use changes no answer, free-queue order, cached-block list
    or snapshot, compared with a pool whose blocks all exist from the start (the lazy
    pool's free queue compacts its list as often as it can)."""
    lazy = KVCachePool(config)
    lazy.block_pool.free_block_queue.compact_slack = 0
    eager = KVCachePool(config, materialize_blocks=True)
    assert len(eager.block_pool.blocks) == config.num_blocks
    assert len(lazy.block_pool.blocks) <= 1 + sum(getattr(g, "sink_len", None) or 0 for g in config.groups)
    assert lazy.snapshot() == eager.snapshot()
    a = drive(lazy, random.Random(seed), steps, snapshots=True)
    b = drive(eager, random.Random(seed), steps, snapshots=True)
    assert a == b
    assert lazy.snapshot() == eager.snapshot()
