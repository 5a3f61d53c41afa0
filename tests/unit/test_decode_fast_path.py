"""KVCachePool.update_and_allocate's decode fast path (a step inside the request's
blocks answered at once) answers, refuses and fails exactly as the general path does,
and leaves the same pool, events and statistics.

Two pools of one layout get the same random scheduler calls, the fast path off in one;
after every call their answers (or errors), whole states, events and statistics must
be equal.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import pytest
from kvcoord.client.hashing import BlockHasher, BlockHasher033, block_hasher, none_hash
from kvcoord.engine import (
    ChunkedLocalAttentionSpec,
    EngineError,
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from kvcoord.engine.state import export_state

ALGO = "sha256_cbor"
BS = 4
MAX_LEN = 48

#: name -> (groups, KVCacheConfig keywords)
LAYOUTS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "full4": ((FullAttentionSpec(BS),), {}),
    "full4-nocache": ((FullAttentionSpec(BS),), {"enable_caching": False}),
    "full4+full8": ((FullAttentionSpec(BS), FullAttentionSpec(8)), {}),
    "full4+swa4w8": ((FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)), {}),
    "full4+chunked4c8": ((FullAttentionSpec(BS), ChunkedLocalAttentionSpec(BS, 8)), {}),
    "full4+mamba-align": ((FullAttentionSpec(BS), MambaSpec(BS, MambaCacheMode.ALIGN, 1)), {}),
    "full4-033": ((FullAttentionSpec(BS),), {"profile": "vllm-0.33"}),
    "full4-033-lookahead1": (
        (FullAttentionSpec(BS),),
        {"profile": "vllm-0.33", "num_hash_lookahead_tokens": 1},
    ),
    "full4+swa4w8-033": ((FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)), {"profile": "vllm-0.33"}),
}


def observed(pool: KVCachePool) -> tuple[object, ...]:
    """What a caller can tell about the pool after a call."""
    stats = pool.prefix_cache_stats
    return (
        export_state(pool),
        pool.snapshot(),
        pool.take_events(),
        None if stats is None else dataclasses.astuple(stats),
        pool.num_refusals,
        pool.num_free_blocks,
    )


def call(pool: KVCachePool, name: str, *args: Any, **kw: Any) -> object:
    try:
        return ("ok", getattr(pool, name)(*args, **kw))
    except EngineError as err:
        return ("error", type(err).__name__, str(err))


class Twins:
    """The same calls on two pools: the fast path on in ``fast``, off in ``slow``."""

    def __init__(self, layout: str, seed: int) -> None:
        groups, kw = LAYOUTS[layout]
        self.config = KVCacheConfig(
            num_blocks=64,
            groups=groups,
            hash_block_size=BS,
            enable_kv_cache_events=True,
            max_model_len=MAX_LEN,
            **kw,
        )
        self.fast, self.slow = KVCachePool(self.config), KVCachePool(self.config)
        self.slow.decode_fast_path = False
        self.taken = 0
        inner = self.fast._decode_inside_blocks

        def counted(*a: Any) -> bool:
            took = inner(*a)
            self.taken += took
            return took

        self.fast._decode_inside_blocks = counted  # type: ignore[method-assign]
        self.rnd = random.Random(seed)
        profile = self.config.profile
        self.none = none_hash(ALGO, "0", profile=profile)

    def both(self, name: str, *args: Any, **kw: Any) -> object:
        a = call(self.fast, name, *args, **kw)
        b = call(self.slow, name, *args, **kw)
        assert a == b, (name, args, kw)
        assert observed(self.fast) == observed(self.slow), (name, args, kw)
        return a

    def hasher(self) -> BlockHasher | BlockHasher033:
        return block_hasher(
            self.config.profile,
            ALGO,
            BS,
            self.none,
            num_hash_lookahead_tokens=self.config.num_hash_lookahead_tokens,
        )

    def add(self, rid: str, prompt: Sequence[int]) -> None:
        hashes = self.hasher().extend(list(prompt)) if self.config.enable_caching else []
        self.both("add_request", rid, list(prompt), hashes)

    def admit(self, rid: str, prefixes: Sequence[Sequence[int]]) -> bool:
        """Register ``rid`` with a prompt starting with one of ``prefixes`` and allocate
        it (with a prefix lookup); ``False`` (freed again) when the pool refused it."""
        rnd = self.rnd
        prompt = [*rnd.choice(prefixes), *(rnd.randrange(60) for _ in range(rnd.randint(1, 12)))]
        self.add(rid, prompt)
        answer = self.both("allocate_slots_with_lookup", rid, len(prompt))
        if answer[0] == "ok" and answer[1].new_block_ids is not None:  # type: ignore[index]
            return True
        self.both("free", rid)
        return False

    def hashes_for(self, rid: str, tokens: list[int]) -> list[bytes]:
        """The new hashes ``tokens`` would complete for the request as the pool holds it."""
        if not self.config.enable_caching:
            return []
        req = self.slow.requests[rid]
        h = self.hasher()
        assert len(h.extend(list(req.all_token_ids))) == len(req.block_hashes)
        return h.extend(tokens)

    def decode(self, rid: str) -> None:
        """One running request's step: usually a plain decode, sometimes a variant the
        fast path must leave to the general path (or a bad call both must refuse)."""
        rnd = self.rnd
        req = self.slow.requests[rid]
        n_tok = req.num_tokens
        computed: int | None = n_tok
        tokens = [rnd.randrange(60)]
        num_new, look = 1, 0
        kind = rnd.choices(
            (
                "decode",
                "spec",
                "lookahead",
                "none",
                "bad_token",
                "bad_hash",
                "no_hash",
                "behind",
                "lag",
                "huge",
                "bool",
            ),
            (65, 5, 5, 4, 3, 3, 3, 3, 5, 2, 2),
        )[0]
        if kind == "spec":
            tokens += [rnd.randrange(60) for _ in range(rnd.randint(1, 2))]
            num_new = len(tokens) + rnd.randint(0, 2)
        elif kind == "lookahead":
            look = rnd.randint(1, 5)
        elif kind == "none":
            computed = None
        elif kind == "behind":
            computed = max(n_tok - rnd.randint(1, 6), 0)
            num_new = n_tok + 1 - computed
        elif kind == "lag":  # the step before's token not computed yet (async scheduling)
            computed = max(n_tok - 1, 0)
        elif kind == "huge":
            num_new = MAX_LEN
        hashes = self.hashes_for(rid, tokens)
        if kind == "bad_token":
            tokens[0] = -1
        elif kind == "bad_hash":
            hashes = hashes + [b"\x01" * 32]
        elif kind == "no_hash":
            hashes = []
        elif kind == "bool":
            num_new = True  # type: ignore[assignment]
        self.both("update_and_allocate", rid, computed, tokens, hashes, num_new, look)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fast_path_equals_general_path(layout: str) -> None:
    t = Twins(layout, seed=sum(map(ord, layout)))
    rnd = t.rnd
    prefixes = [[rnd.randrange(60) for _ in range(n)] for n in (3, 8, 13)]
    running: list[str] = []
    for step in range(300):
        if len(running) < 6 and rnd.random() < 0.5 and t.admit(f"r{step}", prefixes):
            running.append(f"r{step}")
        for rid in list(running):
            req = t.slow.requests[rid]
            if rnd.random() < 0.05 or (req.num_tokens >= MAX_LEN and rnd.random() < 0.3):
                t.both("free", rid)
                running.remove(rid)
                continue
            t.decode(rid)
    assert t.taken > 200 if t.fast.decode_fast_path else t.taken == 0, t.taken
