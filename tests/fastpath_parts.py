"""The layouts, values and comparisons of tests/fastpath_diff.py's differential fuzz."""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from typing import Any

from kvcoord.engine import (
    ChunkedLocalAttentionSpec,
    EngineError,
    FullAttentionSpec,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    TokenIds,
)
from kvcoord.engine.state import export_state

BS = 4
Layout = tuple[tuple[Any, ...], dict[str, Any]]
V33 = {"profile": "vllm-0.33"}
#: name -> (groups, KVCacheConfig keywords); max_model_len 45 (not a block multiple) or 48
LAYOUTS: dict[str, Layout] = {
    "full4": ((FullAttentionSpec(BS),), {}),
    "full4-nocache": ((FullAttentionSpec(BS),), {"enable_caching": False}),
    "full4-len48": ((FullAttentionSpec(BS),), {"max_model_len": 48}),
    "full4-eagle": ((FullAttentionSpec(BS),), {"use_eagle": True}),
    "full4-hashlen": ((FullAttentionSpec(BS),), {"hash_length": 32}),
    "full4+full8": ((FullAttentionSpec(BS), FullAttentionSpec(8)), {}),
    "full4+full8-eagle": ((FullAttentionSpec(BS), FullAttentionSpec(8)), {"use_eagle": True}),
    "full4+swa4w8": ((FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)), {}),
    "swa4w8": ((SlidingWindowSpec(BS, 8),), {}),
    "full4+chunked4c8": ((FullAttentionSpec(BS), ChunkedLocalAttentionSpec(BS, 8)), {}),
    "full4+swa4w8-nocache": ((FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)), {"enable_caching": False}),
    "full4+mamba-align": ((FullAttentionSpec(BS), MambaSpec(BS, MambaCacheMode.ALIGN, 1)), {}),
    "full4+mamba-none": ((FullAttentionSpec(BS), MambaSpec(BS)), {}),
    "full4-033": ((FullAttentionSpec(BS),), V33),
    "full4-033-hashlen": ((FullAttentionSpec(BS),), {**V33, "hash_length": 32}),
    "full4-033-la1": ((FullAttentionSpec(BS),), {**V33, "num_hash_lookahead_tokens": 1}),
    "full4-033-la2": ((FullAttentionSpec(BS),), {**V33, "num_hash_lookahead_tokens": 2}),
    "full4-033-la3": ((FullAttentionSpec(BS),), {**V33, "num_hash_lookahead_tokens": 3}),
    "full4-033-zeroing": ((FullAttentionSpec(BS),), {**V33, "needs_kv_cache_zeroing": True}),
    "full4+swa4w8-033": ((FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)), V33),
    "full4+full8-033": ((FullAttentionSpec(BS), FullAttentionSpec(8)), V33),
    "full4+mamba-033": ((FullAttentionSpec(BS), MambaSpec(BS, MambaCacheMode.ALIGN)), V33),
    "full8+mamba8-033-partial": ((FullAttentionSpec(8), MambaSpec(8, MambaCacheMode.ALIGN)), V33),
}


class MyInt(int):
    """An int subclass (the fast paths read ``type(x) is int``)."""


class Num(enum.IntEnum):
    ONE = 1


#: values the fast paths must leave to the general path, which refuses or takes them
ODD_VALUES: tuple[object, ...] = (True, False, -1, 1 << 40, MyInt(1), Num.ONE, 1.0, None, "1")


class Bytes(bytes):
    """A bytes subclass (hashes must be ``bytes`` itself)."""


def answer(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[object, ...]:
    """A call's answer or its error (type and message)."""
    try:
        return ("ok", fn(*args, **kw))
    except EngineError as err:
        return ("error", type(err).__name__, str(err))


def observed(pool: KVCachePool) -> tuple[object, ...]:
    """What a caller can tell about the pool: its whole state (pending events left out),
    the events taken, the zeroing records. The hash epoch is read only as the pool reads
    it: whether each request's recorded hit was looked up at the current one (a sliced
    allocation moves it once per slice that evicts, the call at once once)."""
    state = export_state(pool)
    del state["pending_events"]
    epoch = state["counters"][1]
    state["counters"][1] = None
    for req in state["requests"]:
        if req[7] is not None:  # (last_hit: its block ids and epoch)
            req[7][1] = req[7][1] == epoch
    return state, pool.take_events(), [list(g) for g in pool.pending_new_block_ids]


def make_general(pool: KVCachePool) -> KVCachePool:
    """Every fused path of ``pool`` off: the coordinator's general path throughout."""
    pool._plain_managers = False
    pool.decode_fast_path = False
    pool._lone_manager = None
    pool._fused_free = None
    return pool


def drain(gen: Any) -> Any:
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def token_list(rnd: random.Random, tokens: Sequence[Any]) -> Sequence[Any]:
    """The tokens as a list, a tuple, TokenIds (when they are such) or another sequence."""
    r = rnd.random()
    if r < 0.1:
        return tuple(tokens)
    if r < 0.2 and all(type(t) is int and t >= 0 for t in tokens):
        return TokenIds(tokens)
    if r < 0.25:
        return _Seq(tokens)
    return list(tokens)


class _Seq(Sequence[Any]):
    """A sequence of another type (the fast paths read lists, tuples and TokenIds)."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __getitem__(self, i: Any) -> Any:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)


def first_difference(a: object, b: object) -> object:
    """Where two observed values first differ (for the assertion message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if a[k] != b.get(k):
                return k, a[k], b.get(k)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            if x != y:
                return first_difference(x, y)
    return a, b
