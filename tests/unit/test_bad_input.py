"""Bad input raises one documented exception family and leaves the pool unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from kvcoord.client.hashing import BlockHasher
from kvcoord.engine import (
    CacheHit,
    EngineError,
    ErrorStatus,
    FailedPreconditionError,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    RequestExistsError,
    RequestNotFoundError,
    SlidingWindowSpec,
    StaleCacheHitError,
    TokenIds,
)
from support import ALGO, NONE, Driver, toks


def busy_driver() -> Driver:
    """A hybrid pool with a running request, a freed one's cached blocks, and a waiting one."""
    d = Driver(
        (FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
        num_blocks=40,
        max_model_len=64,
        enable_kv_cache_events=True,
        hash_length=32,
    )
    d.admit("done", toks(1, 20))
    d.pool.free("done")
    d.admit("run", toks(1, 14))
    d.append("run", [15], 14)
    d.add("wait", toks(1, 18))
    return d


def _unknown(p: KVCachePool) -> list[Callable[[], object]]:
    return [
        lambda: p.get_computed_blocks("nope"),
        lambda: p.allocate_slots("nope", 1),
        lambda: p.allocate_slots_with_lookup("nope", 8),
        lambda: p.free("nope"),
        lambda: p.preempt("nope"),
        lambda: p.update_request("nope", num_computed_tokens=1),
        lambda: p.cache_blocks("nope", 4),
        lambda: p.remove_skipped_blocks("nope", 4),
        lambda: p.get_block_ids("nope"),
        lambda: p.get_num_common_prefix_blocks("nope"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_unknown_request_is_not_found(index: int) -> None:
    """Every per-request call on an unknown id raises RequestNotFoundError (NOT_FOUND)."""
    d = busy_driver()
    before = d.pool.snapshot()
    with pytest.raises(RequestNotFoundError, match="'nope' is not in this pool") as err:
        _unknown(d.pool)[index]()
    assert err.value.status is ErrorStatus.NOT_FOUND
    assert d.pool.snapshot() == before


CASES: list[tuple[str, Callable[[Driver], object], type[EngineError], str]] = [
    ("duplicate id", lambda d: d.pool.add_request("run", [1]), RequestExistsError, "already exists"),
    ("empty id", lambda d: d.pool.add_request("", [1]), InvalidArgumentError, "non-empty"),
    ("negative token", lambda d: d.pool.add_request("x", [-1]), InvalidArgumentError, "non-negative"),
    (
        "prompt too long",
        lambda d: d.pool.add_request("x", list(range(65)), []),
        InvalidArgumentError,
        "max_model_len",
    ),
    (
        "missing hashes",
        lambda d: d.pool.add_request("x", toks(1, 8), []),
        InvalidArgumentError,
        "expected 2 new block hashes",
    ),
    ("short hash", lambda d: d.pool.add_request("x", toks(1, 4), [b"ab"]), InvalidArgumentError, "32 bytes"),
    ("str hash", lambda d: d.pool.add_request("x", toks(1, 4), ["a" * 32]), InvalidArgumentError, "bytes"),
    (
        "append too long",
        lambda d: d.pool.update_request("run", append_token_ids=[1] * 60),
        InvalidArgumentError,
        "max_model_len",
    ),
    (
        "wire tokens too long",
        lambda d: d.pool.update_request("run", append_token_ids=TokenIds([1] * 60)),
        InvalidArgumentError,
        "max_model_len",
    ),
    (
        "append no hash",
        lambda d: d.pool.update_request("run", append_token_ids=[1]),
        InvalidArgumentError,
        "expected 1 new block hashes",
    ),
    (
        "computed negative",
        lambda d: d.pool.update_request("run", num_computed_tokens=-3),
        InvalidArgumentError,
        ">= 0",
    ),
    (
        "computed beyond",
        lambda d: d.pool.update_request("run", num_computed_tokens=65),
        InvalidArgumentError,
        "max_model_len",
    ),
    (
        "nothing to allocate",
        lambda d: d.pool.allocate_slots("run", 0),
        InvalidArgumentError,
        "num_new_tokens must be > 0",
    ),
    (
        "negative new",
        lambda d: d.pool.allocate_slots("run", -1),
        InvalidArgumentError,
        "num_new_tokens must be >= 0",
    ),
    ("bool count", lambda d: d.pool.allocate_slots("run", True), InvalidArgumentError, "integer"),
    (
        "negative lookahead",
        lambda d: d.pool.allocate_slots("run", 1, num_lookahead_tokens=-1),
        InvalidArgumentError,
        "num_lookahead_tokens",
    ),
    (
        "beyond max_model_len",
        lambda d: d.pool.allocate_slots("run", 60),
        InvalidArgumentError,
        "exceed max_model_len",
    ),
    (
        "computed without hit",
        lambda d: d.pool.allocate_slots("wait", 2, 16),
        InvalidArgumentError,
        "no prefix-hit blocks",
    ),
    (
        "hit group count",
        lambda d: d.pool.allocate_slots("wait", 2, 16, [[1, 2, 3, 4]]),
        InvalidArgumentError,
        "one list per KV cache group",
    ),
    (
        "hit too short",
        lambda d: d.pool.allocate_slots("wait", 2, 16, [[1, 2], [0, 0]]),
        InvalidArgumentError,
        "cover fewer",
    ),
    (
        "hit bad id",
        lambda d: d.pool.allocate_slots("wait", 2, 4, [[999], [0]]),
        InvalidArgumentError,
        "invalid block id",
    ),
    (
        "null in full",
        lambda d: d.pool.allocate_slots("wait", 2, 4, [[0], [0]]),
        InvalidArgumentError,
        "null block",
    ),
    (
        "stale hit",
        lambda d: d.pool.allocate_slots("wait", 2, 4, [[7], [0]]),
        StaleCacheHitError,
        "no longer cached",
    ),
    (
        "hit on running",
        lambda d: d.pool.allocate_slots("run", 1, 4, [d.pool.get_block_ids("run")[0][:1], [0]]),
        FailedPreconditionError,
        "already holds blocks",
    ),
    (
        "lookup when running",
        lambda d: d.pool.allocate_slots_with_lookup("run", 4),
        FailedPreconditionError,
        "already running",
    ),
    ("evict out of range", lambda d: d.pool.evict_blocks([1, 40]), InvalidArgumentError, "out of range"),
    ("cache beyond held", lambda d: d.pool.cache_blocks("wait", 16), FailedPreconditionError, "holds only 0"),
    ("cache beyond tokens", lambda d: d.pool.cache_blocks("run", 40), InvalidArgumentError, "exceeds"),
    ("skip negative", lambda d: d.pool.remove_skipped_blocks("run", -1), InvalidArgumentError, ">= 0"),
]


@pytest.mark.parametrize(("name", "call", "exc", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_changes_nothing(
    name: str, call: Callable[[Driver], object], exc: type[EngineError], message: str
) -> None:
    """The right exception, an actionable message, and an identical pool snapshot."""
    d = busy_driver()
    before = d.pool.snapshot()
    with pytest.raises(exc, match=message):
        call(d)
    assert d.pool.snapshot() == before


def test_stale_hit_after_eviction_by_another_request() -> None:
    """A hint looked up before another request evicted its blocks is refused, not adopted."""
    d = Driver((FullAttentionSpec(4),), num_blocks=8)
    d.admit("A", toks(1, 12))
    d.pool.free("A")
    d.add("B", toks(1, 12))
    hit = d.hit("B")
    assert hit.block_ids == ((1, 2),)
    d.admit("C", toks(100, 127))  # takes every free block, evicting 1 and 2
    d.pool.free("C")
    before = d.pool.snapshot()
    with pytest.raises(StaleCacheHitError):
        d.pool.allocate_slots("B", 4, 8, hit)
    assert d.pool.snapshot() == before


def test_mamba_align_shrinking_table_is_refused_before_any_change() -> None:
    """Align mode cannot shrink a request's table (vLLM asserts); FAILED_PRECONDITION, pool unchanged."""
    d = Driver((FullAttentionSpec(4), MambaSpec(4, MambaCacheMode.ALIGN, 1)), num_blocks=20)
    d.add("A", toks(1, 20))
    assert d.pool.allocate_slots("A", 8) == ((1, 2), (0, 3, 4))
    d.append("A", [], 0)
    before = d.pool.snapshot()
    with pytest.raises(FailedPreconditionError, match="go backwards"):
        d.pool.allocate_slots("A", 4)
    assert d.pool.snapshot() == before


def test_atomic_lookup_allocation() -> None:
    """allocate_slots_with_lookup adopts the hit and schedules up to the token budget."""
    d = Driver((FullAttentionSpec(4),), num_blocks=20)
    d.admit("A", toks(1, 12))
    d.add("B", toks(1, 20))
    res = d.pool.allocate_slots_with_lookup("B", 4)
    assert res.hit == CacheHit(((1, 2, 3),), 12)
    assert res.num_new_tokens == 4
    assert res.new_block_ids == ((4,),)
    assert d.ids("B") == ((1, 2, 3, 4),)


def test_a_hit_is_checked_against_the_adopting_request() -> None:
    """Block ids looked up for one request cannot be adopted by a request with another prefix."""
    d = Driver((FullAttentionSpec(4),), num_blocks=20)
    d.admit("A", toks(1, 12))
    d.add("B", toks(1, 12))
    hit_b = d.hit("B")
    assert hit_b.block_ids == ((1, 2),)
    d.add("C", toks(50, 61))
    before = d.pool.snapshot()
    with pytest.raises(StaleCacheHitError, match="block 1 at position 0"):
        d.pool.allocate_slots("C", 4, 8, hit_b)
    assert d.pool.snapshot() == before


DEGENERATE: list[tuple[str, Callable[[Driver], object], str]] = [
    ("empty prompt", lambda d: d.pool.add_request("x", [], []), "prompt_token_ids is empty"),
    ("empty prompt, no hashes arg", lambda d: d.pool.add_request("x", []), "prompt_token_ids is empty"),
    ("zero-token lookup", lambda d: d.pool.find_longest_cache_hit([], 0), "between 1 and max_model_len"),
    ("negative lookup", lambda d: d.pool.find_longest_cache_hit([], -4), "between 1 and max_model_len"),
    ("lookup too long", lambda d: d.pool.find_longest_cache_hit([b"h" * 32] * 16, 65), "max_model_len 64"),
    ("lookup bool count", lambda d: d.pool.find_longest_cache_hit([], True), "integer"),
    ("lookup hash count", lambda d: d.pool.find_longest_cache_hit([b"h" * 32], 9), "expected 2 new block"),
    ("lookup hash length", lambda d: d.pool.find_longest_cache_hit([b"h" * 31], 4), "32 bytes"),
    ("lookup hash type", lambda d: d.pool.find_longest_cache_hit(["h" * 32], 4), "bytes"),
    ("lookup one hash", lambda d: d.pool.find_longest_cache_hit(b"h" * 32, 4), "sequence of bytes"),
    (
        "atomic lookup, nothing to schedule",
        lambda d: d.pool.allocate_slots_with_lookup("wait", 0),
        "max_num_new_tokens must be > 0",
    ),
    (
        "atomic lookup, bad flag after the search",
        lambda d: d.pool.allocate_slots_with_lookup("wait", 4, delay_cache_blocks="yes"),  # type: ignore[arg-type]
        "delay_cache_blocks must be a bool",
    ),
]


@pytest.mark.parametrize(("name", "call", "message"), DEGENERATE, ids=[c[0] for c in DEGENERATE])
@pytest.mark.parametrize("hybrid", [False, True], ids=["unitary", "hybrid"])
def test_degenerate_input_is_invalid_and_changes_nothing(
    name: str, call: Callable[[Driver], object], message: str, hybrid: bool
) -> None:
    """Input vLLM never sends (empty prompts, zero-token lookups, nothing to schedule) is
    INVALID_ARGUMENT with the pool, its statistics and its lifetime counters unchanged."""
    groups = (FullAttentionSpec(4), SlidingWindowSpec(4, 8)) if hybrid else (FullAttentionSpec(4),)
    d = Driver(groups, num_blocks=40, max_model_len=64, enable_kv_cache_events=True, hash_length=32)
    d.admit("done", toks(1, 20))
    d.pool.free("done")
    d.add("wait", toks(1, 18))
    before = d.pool.snapshot()
    counters = dataclasses.replace(
        d.pool.lookup_counters, group_hit_tokens=list(d.pool.lookup_counters.group_hit_tokens)
    )
    with pytest.raises(InvalidArgumentError, match=message):
        call(d)
    assert d.pool.snapshot() == before
    assert d.pool.lookup_counters == counters
    stats = d.pool.make_prefix_cache_stats()
    assert stats is not None and min(stats.requests, stats.queries, stats.hits) >= 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["unitary", "hybrid"])
def test_one_token_prompt_is_served(hybrid: bool) -> None:
    """The shortest real prompt (one token) looks up nothing, allocates one block per group,
    and keeps every counter non-negative."""
    groups = (FullAttentionSpec(4), SlidingWindowSpec(4, 8)) if hybrid else (FullAttentionSpec(4),)
    d = Driver(groups, num_blocks=10)
    hit, new = d.admit("one", [7])
    assert hit.num_tokens == 0 and hit.is_empty
    assert new == tuple((i + 1,) for i in range(len(groups)))
    assert d.pool.find_longest_cache_hit([], 1) == hit
    stats = d.pool.make_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (1, 1, 0)
    assert d.pool.lookup_counters.hits == 0


def test_wire_token_ids_are_copied_and_only_their_length_is_checked() -> None:
    """TokenIds (what the server reads from a uint32 field) skip the per-token checks,
    not the length check, and the pool keeps its own plain copy."""
    d = Driver(max_model_len=16)
    given = TokenIds(toks(1, 8))
    d.pool.add_request("w", given, BlockHasher(ALGO, 4, NONE).extend(given))
    given.append(99)  # the caller's list is not the request's
    assert d.pool.requests["w"].all_token_ids == toks(1, 8)
    assert type(d.pool.requests["w"].all_token_ids) is list
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        d.pool.update_request("w", append_token_ids=TokenIds([1] * 9))
    assert d.pool.requests["w"].all_token_ids == toks(1, 8)
