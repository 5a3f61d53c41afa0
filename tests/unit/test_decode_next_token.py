"""decode_run's next-token loop applies a block's first token (one new block) and its
last (its hash appended, that block cached) itself, not through ``grow_entry``: every such
entry must leave the answer, the pool, its events and its statistics exactly as the
general path does (test_decode_run.py's twins: one pool by runs, one entry by entry
with the fast paths off), including the cases the loop hands back: a refusal at a
block's first token, a bad hash at its last, a request in a cache namespace (whose
block ``_cache_one`` leaves to the general caching path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import kvcoord.engine.decode_run as decode_run
import pytest
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool
from unit.test_decode_fast_path import BS, MAX_LEN, observed
from unit.test_decode_run import Columns, Steps, by_run, one_by_one


class Counted:
    """Which block-pool calls the next-token loop made itself (outside ``grow_entry``)."""

    def __init__(self, pool: KVCachePool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.new = self.cached = self.general_cache = self.grown = 0
        self.in_grow = False
        grow, cache_one, take = decode_run.grow_entry, decode_run._cache_one, pool.block_pool.get_new_blocks
        general = pool.cache_full_request_blocks

        def counted_grow(*a: Any) -> bool:
            self.grown += 1
            self.in_grow = True
            try:
                return grow(*a)
            finally:
                self.in_grow = False

        def counted_cache_one(*a: Any) -> bool:
            self.cached += not self.in_grow
            return cache_one(*a)

        def counted_take(n: int) -> Any:
            self.new += not self.in_grow and n == 1
            return take(n)

        def counted_general(*a: Any) -> None:
            self.general_cache += not self.in_grow
            general(*a)

        monkeypatch.setattr(decode_run, "grow_entry", counted_grow)
        monkeypatch.setattr(decode_run, "_cache_one", counted_cache_one)
        monkeypatch.setattr(pool.block_pool, "get_new_blocks", counted_take)
        monkeypatch.setattr(pool, "cache_full_request_blocks", counted_general)


class NamespacedSteps(Steps):
    """:class:`Steps` (in pools with a hash length, which namespaces need) whose
    requests are registered half in a cache namespace, half in vLLM's."""

    mix = "decode"

    def __init__(self, layout: str, seed: int) -> None:
        super().__init__(layout, seed)
        self.config = dataclasses.replace(self.config, hash_length=32)
        self.fast, self.slow = KVCachePool(self.config), KVCachePool(self.config)
        self.slow.decode_fast_path = False

    def add(self, rid: str, prompt: Any) -> None:
        hashes = self.hasher().extend(list(prompt))
        namespace = "tenant-a" if self.rnd.random() < 0.5 else ""
        self.both("add_request", rid, list(prompt), hashes, cache_namespace=namespace)


@pytest.mark.parametrize("namespaced", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_block_first_and_last_token_in_the_loop_equal_the_general_path(
    namespaced: bool, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = (NamespacedSteps if namespaced else Steps)("full4", seed=seed)
    t.mix = "decode"
    seen = Counted(t.fast, monkeypatch)
    rnd = t.rnd
    prefixes = [[rnd.randrange(60) for _ in range(n)] for n in (3, 8, 13)]
    running: list[str] = []
    for step in range(200):
        while len(running) < 12 and rnd.random() < 0.6:  # 12 x 12 blocks > 64: refusals
            rid = f"r{step}-{len(running)}"
            if not t.admit(rid, prefixes):
                break
            running.append(rid)
        t.step(running)
        for rid in list(running):
            if rnd.random() < 0.04 or (t.slow.requests[rid].num_tokens >= MAX_LEN - 2 and rnd.random() < 0.5):
                t.both("free", rid)
                running.remove(rid)
    assert seen.new > 100 and seen.cached > 100, vars(seen)  # the loop's own two cases, often
    if namespaced:
        assert seen.general_cache > 50, vars(seen)  # _cache_one declined: the general caching
    assert t.fast.num_refusals > 0  # (some of them at a block's first token)


def _twins(num_blocks: int) -> tuple[KVCachePool, KVCachePool]:
    config = KVCacheConfig(
        num_blocks=num_blocks, groups=(FullAttentionSpec(BS),), hash_block_size=BS,
        enable_kv_cache_events=True, max_model_len=MAX_LEN,
    )  # fmt: skip
    fast, slow = KVCachePool(config), KVCachePool(config)
    slow.decode_fast_path = False
    return fast, slow


def _entry(cols: Columns, pool: KVCachePool, rid: str, token: int, hashes: list[bytes]) -> None:
    req = pool.requests[rid]
    n = len(req.all_token_ids)
    cols.request_ids.append(rid)
    cols.base_num_tokens.append(n)
    cols.base_num_hashes.append(len(req.block_hashes))
    cols.num_computed_tokens.append(n)
    cols.num_new_tokens.append(1)
    cols.num_lookahead_tokens.append(0)
    cols.num_append_tokens.append(1)
    cols.append_token_ids.append(token)  # type: ignore[attr-defined]
    cols.num_append_hashes.append(len(hashes))
    cols.append_block_hashes += hashes


def test_a_block_first_token_without_a_free_block_is_refused_as_by_the_general_path() -> None:
    """Three requests of one full block each (4 tokens, hashed) and one free block:
    the first entry takes it; the second is refused (the loop stops there and the
    general path refuses it), and so is the third, in the loop's next call."""
    fast, slow = _twins(5)  # (one block is the null block)
    for pool in (fast, slow):
        for k in range(3):
            tokens = [k, k, k, k]
            hashes = [bytes([k + 1]) * 32]
            pool.add_request(f"r{k}", tokens, hashes)
            assert pool.allocate_slots(f"r{k}", 4) is not None
        assert pool.num_free_blocks == 1
    cols = Columns()
    for k in range(3):
        _entry(cols, slow, f"r{k}", 7, [])
    a, _ = by_run(fast, cols)
    b = one_by_one(slow, cols)
    assert a == b
    counts, _ids, failed = a
    assert failed is None and counts == [1, -1, -1]  # one block free: then two refusals
    assert observed(fast) == observed(slow)
