"""``KVCachePool.update_and_allocate(..., inside_checked=True)``, what the predicted
client calls for a decode step whose ``decode_token`` just answered ``None`` (a block
to take), answers and leaves the pool exactly as the call that checks again does; and
so does ``KVCachePool.decode_step``, which the client calls before it (a block to take
or to cache, in a pool of one group).

Two pools of one layout get the same random decode workload (the predicted client's
order: ``decode_token`` first, then ``decode_step``, the general call only when they
answer ``None``); after every call their answers (or errors), whole states, events and
statistics are equal."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    SlidingWindowSpec,
)
from test_decode_fast_path import call as _call
from test_decode_fast_path import observed as _observed

ALGO = "sha256_cbor"
BS = 4
MAX_LEN = 64
LAYOUTS: dict[str, tuple[Any, ...]] = {
    "full4": (FullAttentionSpec(BS),),
    "full4+full8": (FullAttentionSpec(BS), FullAttentionSpec(8)),
    "full4+swa4w8": (FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)),
}


#: how many steps each of the client's calls answered (decode_token, decode_step)
ANSWERED = {"decode_token": 0, "decode_step": 0}


def _step(pool: KVCachePool, checked: bool, rid: str, computed: int, token: int, hashes: list[bytes],
          num_new: int, look: int) -> object:  # fmt: skip
    """One running request's decode step as the predicted client makes it (``checked``)
    or as the general call (``update_and_allocate`` checking the decode path itself)."""
    if checked and len(hashes) <= 1:
        got = pool.decode_token(rid, computed, token, num_new, look) if not hashes else None
        if got is not None:
            ANSWERED["decode_token"] += 1
            return ("ok", got)
        got = pool.decode_step(rid, computed, token, hashes[0] if hashes else None, num_new, look)
        if got is not None:
            ANSWERED["decode_step"] += 1
            return ("ok", got)
        return _call(
            pool, "update_and_allocate", rid, computed, [token], hashes, num_new, look, inside_checked=True
        )
    return _call(pool, "update_and_allocate", rid, computed, [token], hashes, num_new, look)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(3))
def test_a_checked_decode_step_is_the_general_step(layout: str, seed: int) -> None:
    before = dict(ANSWERED)
    config = KVCacheConfig(
        num_blocks=40,
        groups=LAYOUTS[layout],
        hash_block_size=BS,
        enable_kv_cache_events=True,
        max_model_len=MAX_LEN,
    )
    pools = (KVCachePool(config), KVCachePool(config))  # (the client's order, the general call)
    rnd = random.Random(seed)
    none = none_hash(ALGO, "0")
    hashers: dict[str, BlockHasher] = {}
    prefixes = [[rnd.randrange(60) for _ in range(n)] for n in (3, 8, 13)]
    taken = 0

    def both(name: str, *args: Any) -> object:
        a, b = (_call(p, name, *args) for p in pools)
        assert a == b and _observed(pools[0]) == _observed(pools[1]), (name, args)
        return a

    running: list[str] = []
    for step in range(200):
        if len(running) < 6 and rnd.random() < 0.5:
            rid = f"r{step}"
            prompt = [*rnd.choice(prefixes), *(rnd.randrange(60) for _ in range(rnd.randint(1, 12)))]
            hashers[rid] = BlockHasher(ALGO, BS, none)
            both("add_request", rid, prompt, hashers[rid].extend(prompt))
            got = both("allocate_slots_with_lookup", rid, len(prompt))
            if got[0] == "ok" and got[1].new_block_ids is not None:  # type: ignore[index]
                running.append(rid)
            else:
                both("free", rid)
        for rid in list(running):
            req = pools[1].requests[rid]
            if rnd.random() < 0.05 or req.num_tokens >= MAX_LEN - 8:
                both("free", rid)
                running.remove(rid)
                continue
            token = rnd.randrange(60)
            look = rnd.choice((0, 0, 0, 2))
            computed = req.num_tokens if rnd.random() < 0.95 else max(req.num_tokens - 1, 0)
            hashes = hashers[rid].extend([token])
            new = [
                _step(p, checked, rid, computed, token, hashes, 1, look)
                for p, checked in zip(pools, (True, False), strict=True)
            ]
            assert new[0] == new[1] and _observed(pools[0]) == _observed(pools[1]), (rid, step)
            taken += bool(not hashes and new[0][0] == "ok" and new[0][1] and any(new[0][1]))  # type: ignore[index]
    assert taken > 20  # (steps that took a block after decode_token answered None)
    answered = {k: ANSWERED[k] - before[k] for k in ANSWERED}
    assert answered["decode_token"] > 100
    if layout == "full4":  # (decode_step takes pools of one group only)
        assert answered["decode_step"] > 40, answered
    else:
        assert answered["decode_step"] == 0
