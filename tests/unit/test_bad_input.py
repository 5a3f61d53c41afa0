"""Bad input raises one documented exception family and leaves the pool unchanged."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
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
from kvcoord.service.bounds import (
    BOUNDS,
    ELSEWHERE,
    MAX_REQUEST_ID_LENGTH,
    SIZE_FIRST_ITEMS,
    check_request,
    request_fields,
)
from kvcoord.service.config import ConfigFileError, parse_config
from kvcoord.service.errors import ServiceError
from kvcoord.service.registry import Limits
from kvcoord.v1 import allocator_pb2 as pb
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


# -- input bounds at the wire (service/bounds.py) ----------------------------------------
_LIMITS = Limits(max_tokens_per_request=40, max_ops_per_step=5, max_blocks_per_pool=7)
_REQUESTS = [m.input_type for m in pb.DESCRIPTOR.services_by_name["Allocator"].methods]


def _path_to(message: str) -> tuple[Any, list[str]]:
    """A request type and the field names leading from it to a ``message`` inside it
    (breadth first: the shortest path)."""
    queue: list[tuple[Any, Any, list[str]]] = [(d, d, []) for d in _REQUESTS]
    seen: set[str] = set()
    while queue:
        root, d, path = queue.pop(0)
        if d.name == message:
            return root, path
        if d.full_name in seen:
            continue
        seen.add(d.full_name)
        queue += [(root, f.message_type, [*path, f.name]) for f in d.fields if f.message_type is not None]
    raise AssertionError(f"{message} is in no request")


def _request_with(key: str, size: int) -> tuple[Any, str]:
    """A request whose field ``key`` ("Message.field", "Message.field[]") is ``size``
    long (characters, bytes or items), everything else empty; and the field's name."""
    message, field = key.removesuffix("[]").split(".")
    root, path = _path_to(message)
    request = getattr(pb, root.name)()
    m = request
    for name in path:
        value = getattr(m, name)
        if hasattr(value, "add"):  # a list of messages: one item
            m = value.add()
        else:
            value.SetInParent()
            m = value
    f = m.DESCRIPTOR.fields_by_name[field]
    one = {f.TYPE_STRING: "x", f.TYPE_BYTES: b"x"}.get(f.type, 1)
    target = getattr(m, field)
    if key.endswith("[]"):
        target.append(one * size)
    elif f.type == f.TYPE_MESSAGE:
        for _ in range(size):
            target.add()
    elif f.is_repeated:
        target.extend([one] * size)
    else:
        setattr(m, field, one * size)
    return request, field


@pytest.mark.parametrize("key", sorted(BOUNDS))
def test_each_input_bound_refuses_one_past_it(key: str) -> None:
    """Every bounded field: its bound is accepted, one more is INVALID_ARGUMENT naming
    the field, its length and the bound (and the [limits] setting it comes from)."""
    bound = BOUNDS[key]
    factor, _, setting = str(bound).rpartition(" * ")  # ("4 * setting": a packed column's bytes)
    limit = bound if isinstance(bound, int) else int(factor or 1) * getattr(_LIMITS, setting)
    request, field = _request_with(key, limit)
    check_request(request, _LIMITS)  # at the bound: accepted
    request, field = _request_with(key, limit + 1)
    with pytest.raises(ServiceError) as err:
        check_request(request, _LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    message = err.value.message
    assert f".{field}" in f".{message}" and f"is {limit + 1:,} " in message, message
    assert f"longest accepted is {limit:,}" in message, message
    if isinstance(bound, str):
        assert f"[limits] {bound}" in message, message


def test_every_request_field_has_a_documented_bound() -> None:
    """Every string, bytes and list field of every request is in BOUNDS (or ELSEWHERE,
    bounded by another rule), nothing else is, and docs/input-bounds.md lists exactly
    that table."""
    fields = {key for key, _ in request_fields()}
    strings = {key for key, f in request_fields() if f.type in (f.TYPE_STRING, f.TYPE_BYTES)}
    listed = {k.removesuffix("[]") for k in (*BOUNDS, *ELSEWHERE)}
    assert fields - listed == set(), "fields without a bound"
    assert listed - fields == set(), "bounds of fields that do not exist"
    lists_of_strings = {key for key, f in request_fields() if f.is_repeated} & strings
    assert {k for k in lists_of_strings if f"{k}[]" not in BOUNDS and f"{k}[]" not in ELSEWHERE} == set()
    doc = (Path(__file__).resolve().parents[2] / "docs" / "input-bounds.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Za-z.\[\]_]+)` \| (.+?) \|$", doc, re.MULTILINE))
    expected = {
        **{k: f"{v:,}" if isinstance(v, int) else f"`[limits] {v}`" for k, v in BOUNDS.items()},
        **{k: f"elsewhere: {v}" for k, v in ELSEWHERE.items()},
    }
    assert rows == expected


@pytest.mark.parametrize("small", [3, SIZE_FIRST_ITEMS, SIZE_FIRST_ITEMS + 1, 40])
def test_a_step_of_small_operations_is_checked_by_their_size(small: int) -> None:
    """In a long list, operations no larger than the smallest bound inside them are
    skipped (their size proves them within every bound); in a short one each is checked
    at once. Either way one past a bound is found, named by its place in the Step."""
    ops = [pb.Operation(free=pb.FreeOp(request_id=f"r{i}")) for i in range(small)]
    ops.append(pb.Operation(free=pb.FreeOp(request_id="y" * (MAX_REQUEST_ID_LENGTH + 1))))
    ops.append(pb.Operation(decode=pb.DecodeOp(request_ids=["z" * (MAX_REQUEST_ID_LENGTH + 1)])))
    with pytest.raises(ServiceError, match=rf"ops\[{small}\]\.free\.request_id is 257 characters"):
        check_request(pb.StepRequest(ops=ops), Limits())
    with pytest.raises(ServiceError, match=rf"ops\[{small}\]\.decode\.request_ids\[0\] is 257 characters"):
        check_request(pb.StepRequest(ops=[*ops[:small], ops[-1]]), Limits())
    check_request(pb.StepRequest(ops=ops[:small]), Limits())


class _Reads:
    """Stands for a message: records which fields a checker reads (each is empty)."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.read.append(name)
        return ""

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name
        return False

    def WhichOneof(self, group: str) -> None:  # noqa: N802 - protobuf's name
        return None


def test_a_checker_reads_only_the_fields_it_checks() -> None:
    """A decode Step's per-entry columns are bounded by its entries: the checker does
    not even read them (each read makes a container object: about 13 µs of a
    256-running Step's bounds check, bench/step_split.py); only its appended tokens
    (max_tokens_per_request: a longer column was read whole before it was refused)."""
    from kvcoord.service.bounds import _CHECKERS

    for name, check in _CHECKERS.items():
        m = _Reads()
        check(m, Limits())
        d = getattr(pb, name.rsplit(".", 1)[1]).DESCRIPTOR
        for field in m.read:
            key = f"{d.name}.{field}"
            checked = (
                key in BOUNDS
                or key + "[]" in BOUNDS
                or field in {f.name for f in d.fields if f.message_type is not None}
            )
            assert checked, f"{key} is read but has no bound of its own"
    m = _Reads()
    _CHECKERS["kvcoord.v1.DecodeOp"](m, Limits())
    assert m.read == ["request_ids", "append_token_ids", "packed_append_token_ids"]


def test_the_config_file_is_held_to_the_same_bounds() -> None:
    """A pool declared in the configuration file past an input bound, and a tenant name
    longer than a pool name may be, are refused when the file is loaded."""
    pool = (
        '[[pools]]\nname = "p"\nnum_blocks = 8\nhash_block_size = 4\nhash_algo = "sha256_cbor"\n'
        'hash_seed = "{seed}"\nenable_caching = true\n[[pools.groups]]\ntype = "full"\nblock_size = 4\n'
    )
    parse_config(pool.format(seed="s" * 256))
    with pytest.raises(ConfigFileError, match=r"pools\[0\] \(p\): config\.hash_seed is 257 characters long"):
        parse_config(pool.format(seed="s" * 257))
    tenant = '[tenants.{name}]\ntokens = ["t"]\n'
    parse_config(tenant.format(name="t" * 128))
    with pytest.raises(ConfigFileError, match="a tenant name has at most 128 characters"):
        parse_config(tenant.format(name="t" * 129))
