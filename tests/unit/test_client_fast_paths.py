"""The predicted client's fast paths against its general ones (issue 21 item 6): each
gives what the general path gives, and breaking one fails here."""

from __future__ import annotations

import enum
import random
import types
from typing import Any

import pytest
from kvcoord import engine
from kvcoord.client.errors import KVCoordError
from kvcoord.client.mirror import _check_wire_tokens, wire_tokens
from kvcoord.client.token_lists import as_bytes, token_list
from kvcoord.client.tracking import RequestTracker
from kvcoord.client.vllm_manager import KVCoordKVCacheManager, _hashed_blocks, _Held
from kvcoord.client.vllm_types import (
    KVCacheBlocks,
    _convert_event,
    _event_types,
    _int_hashes,
    convert_engine_events,
)
from kvcoord.engine import FullAttentionSpec, HandedTokenIds, KVCacheConfig, TokenIds
from kvcoord.engine.events import block_removed
from kvcoord.engine.request_table import RequestTable
from kvcoord.v1 import allocator_pb2 as pb


class _Token(enum.IntEnum):
    ONE = 1


class _Index:
    """Not an int, but usable as one (``__index__``), as a numpy integer is."""

    def __repr__(self) -> str:
        return "_Index()"

    def __index__(self) -> int:
        return 3


def _general_accepts(tokens: list[object]) -> bool:
    """What the mirror's general path decides for a prompt: the wire's uint32 check,
    then the engine's own check of every token."""
    table = RequestTable(
        KVCacheConfig(num_blocks=8, groups=(FullAttentionSpec(4),), hash_block_size=4, max_model_len=1 << 20)
    )
    try:
        _check_wire_tokens("r", tokens)  # type: ignore[arg-type]
        table.check_tokens(tokens, 0, "prompt_token_ids")  # type: ignore[arg-type]
    except (KVCoordError, engine.InvalidArgumentError):
        return False
    return True


class _Int(int):
    """An int subclass with int's own repr: marshal cannot write it."""


#: (marshal's int record holds -2**31..2**31-1: its edges are valid or not as uint32)
BAD = [-1, 1 << 32, True, False, 2.0, "7", None, _Token.ONE, _Index(), _Int(5), -(1 << 31), 1 << 31,
       (1 << 31) - 1, 0, [1], (1, 2, 3, 4), b"iiii", 2**63, -(2**63)]  # fmt: skip


@pytest.mark.parametrize("length", [1, 15, 16, 17, 900])
@pytest.mark.parametrize("bad", [*BAD, "none"], ids=repr)
@pytest.mark.parametrize("top", [1 << 31, 1 << 32], ids=["below-2**31", "uint32"])
def test_wire_tokens_takes_exactly_what_the_general_path_takes(length: int, bad: object, top: int) -> None:
    """A prompt checked in bulk (``wire_tokens``: marshal's one C pass for ids below
    2**31, else two C passes, then the engine skips its own) is taken exactly when the
    general checks take it; anything else goes on to them unchanged (so the engine
    names the bad token) or is refused as too big."""
    rng = random.Random(length)
    tokens: list[object] = [rng.randrange(top) for _ in range(length)]
    if bad != "none":
        tokens[rng.randrange(length)] = bad
    accepted = _general_accepts(tokens)
    try:
        got = wire_tokens("r", tokens)  # type: ignore[arg-type]
    except KVCoordError:
        assert not accepted
        return
    if type(got) is TokenIds:
        assert accepted and got == tokens
    else:
        assert got is tokens
        assert accepted == (length < 16 and _general_accepts(tokens))


def test_marshal_check_reads_records_from_the_first() -> None:
    """Records of other lengths cannot line up into ``i`` records: a bool (1 byte)
    followed by values whose bytes hold ``i`` at the shifted places, totalling the
    length of all-int records, is still refused by the one-pass check."""
    from kvcoord.client.mirror import _small_exact_ints

    assert _small_exact_ints(list(range(16)))
    assert not _small_exact_ints([True, 0x69696969, *range(14)])  # 'T' then shifted bytes
    assert not _small_exact_ints([*range(15), -1]) and not _small_exact_ints([*range(15), 1 << 31])
    assert _small_exact_ints([*range(15), (1 << 31) - 1])


def _events() -> list[engine.KVCacheEvent]:
    rng = random.Random(0)
    out: list[engine.KVCacheEvent] = [block_removed(rng.randbytes(32)) for _ in range(5)]
    out.append(engine.BlockRemoved((rng.randbytes(32), rng.randbytes(32))))
    out.append(engine.BlockRemoved((rng.randbytes(32),), medium=""))
    out.append(engine.BlockStored((rng.randbytes(32),), rng.randbytes(32), tuple(range(16)), 16, 3, "lora"))
    out.append(
        engine.BlockStored((rng.randbytes(32),), b"\xfe" * 32, tuple(range(16)), 16, None, None, medium="")
    )
    out.append(engine.BlockStored((rng.randbytes(32),), None, tuple(range(16)), 16, None, None))
    out.append(engine.BlockStored((rng.randbytes(32),) * 2, None, tuple(range(32)), 16, None, None))
    out.append(engine.AllBlocksCleared())
    out.append(block_removed(b"\xff" * 32))
    return out


@pytest.mark.parametrize("ints", ["1", "0"])
def test_converted_events_are_the_general_conversions(monkeypatch: pytest.MonkeyPatch, ints: str) -> None:
    """``convert_engine_events`` converts one-block removals and stores inline: what it gives is
    what the per-event conversion gives, event for event, in order (vLLM 0.33's
    fields: tests/with_vllm, with vLLM 0.33's types)."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", ints)
    events = _events()
    types = _event_types()
    want = [_convert_event(e, *types, _int_hashes(), False) for e in events]
    assert convert_engine_events(events) == want


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, "mixed", "tuple"])
def test_hashes_given_as_bytes_are_what_the_general_conversion_gives(kind: object) -> None:
    """The tracker's hashes (``as_bytes``): a list of ``bytes`` is taken as it is, any
    other bytes-like value converted, as ``[bytes(h) for h in hashes]`` would."""
    rng = random.Random(1)
    raw = [rng.randbytes(32) for _ in range(5)]
    if kind == "mixed":
        given: Any = [raw[0], bytearray(raw[1]), *raw[2:]]
    elif kind == "tuple":
        given = tuple(raw)
    else:
        given = [kind(h) for h in raw]  # type: ignore[operator]
    got = as_bytes(given)
    assert got == [bytes(h) for h in given] and {type(h) for h in got} == {bytes}


@pytest.mark.parametrize("length", [1, 15, 16, 900])
@pytest.mark.parametrize("bad", [-1, 1 << 32, True, _Index(), _Int(5), 1 << 31, 2.0, "none"], ids=repr)
@pytest.mark.parametrize("where", ["first", "last", "any"])
@pytest.mark.parametrize("top", [1 << 31, 1 << 32], ids=["below-2**31", "uint32"])
@pytest.mark.parametrize("source", [False, True], ids=["copied", "source"])
def test_a_handed_prompt_is_kept_only_once_checked(
    length: int, bad: object, where: str, top: int, source: bool
) -> None:
    """The tracker's registration (a :class:`HandedTokenIds`) comes back itself, which
    the engine keeps unchecked, only when the bulk check took it; otherwise as a plain
    list, which the engine checks token by token (it names the bad one). The same
    when the check reads the plain list the tokens were copied from (``source``, the
    tracker's :attr:`SyncValues.source_tokens`) instead of a copy of its own."""
    rng = random.Random(length)
    tokens: list[object] = [rng.randrange(top) for _ in range(length)]
    if bad != "none":
        tokens[{"first": 0, "last": length - 1, "any": rng.randrange(length)}[where]] = bad
    accepted = _general_accepts(tokens)
    handed = HandedTokenIds(tokens)  # type: ignore[arg-type]
    try:
        got = wire_tokens("r", handed, tokens if source else None)  # type: ignore[arg-type]
    except KVCoordError:
        assert not accepted
        return
    if got is handed:
        assert accepted and length >= 16
    else:
        assert type(got) is list and got == tokens  # the engine checks each again


def test_a_registration_writes_its_prompt_however_the_engine_extends_it() -> None:
    """A registration's prompt is copied once, into the list the mirror's engine keeps
    and later extends (a decode's tokens) or cuts back (an undone sync): the sync's
    message, written later on the sender thread, carries exactly the prompt."""
    tracker = RequestTracker(pb.PoolConfig(enable_caching=False), b"")
    prompt = list(range(40))
    request = types.SimpleNamespace(request_id="r", all_token_ids=prompt, num_computed_tokens=0)
    values = tracker.sync_values(request)
    assert type(values.tokens) is HandedTokenIds and values.tokens is not prompt
    table = RequestTable(
        KVCacheConfig(
            num_blocks=8,
            groups=(FullAttentionSpec(4),),
            hash_block_size=4,
            max_model_len=1 << 10,
            enable_caching=False,
        )  # fmt: skip
    )
    table.add("r", wire_tokens("r", values.tokens), [], None, False, 0)
    held = table.get("r").all_token_ids
    assert held is values.tokens  # kept, not copied again
    checkpoint = table.checkpoint("r")
    table.update("r", 40, [7, 8, 9], [])  # the engine's list grows after the sync
    prompt.append(5)  # and vLLM's own
    assert list(values.write(pb.RequestSync()).append_token_ids) == list(range(40))
    assert checkpoint is not None
    table.restore("r", checkpoint)
    assert list(values.write(pb.RequestSync()).append_token_ids) == list(range(40))
    later = tracker.sync_values(request)  # the next sync: only vLLM's new token, a plain slice
    assert later.tokens == [5] and type(later.tokens) is list


def test_a_freed_request_registers_again_as_forget_would() -> None:
    """``drop`` (a free's fast path) leaves the tracker as ``forget`` does: the id's next
    sync registers it afresh (a preempted request, reset by vLLM, starts over)."""
    request = types.SimpleNamespace(request_id="r", all_token_ids=list(range(8)), num_computed_tokens=0)
    syncs = []
    for stop in ("drop", "forget"):
        tracker = RequestTracker(pb.PoolConfig(enable_caching=False), b"")
        tracker.sync_values(request)
        assert tracker.drop("r") if stop == "drop" else tracker.forget(["r"]) == ["r"]
        assert "r" not in tracker and not tracker.drop("r")
        syncs.append(tracker.sync_values(request).write(pb.RequestSync()))
    assert syncs[0] == syncs[1] and syncs[0].new_request


@pytest.mark.parametrize("seed", range(20))
def test_lazy_blocks_are_the_blocks_built_at_the_call(seed: int) -> None:
    """vLLM's adapter answers blocks built when first read (their ids at once): they are
    what building them at the call gives, whatever vLLM does meanwhile (hashes
    appended, the request reset, blocks evicted, more tokens cached)."""
    rng = random.Random(seed)
    m = object.__new__(KVCoordKVCacheManager)
    m.enable_caching, m.hash_block_size, m._evicted = True, 16, set()
    m.block_sizes, m._positional = [16, 32, 16], [True, True, False]
    m.empty_kv_cache_blocks = KVCacheBlocks(((), (), ()))
    hashes = [rng.randbytes(32) for _ in range(rng.randrange(0, 40))]
    request = types.SimpleNamespace(block_hashes=hashes)
    held = _Held(request, rng.randrange(0, 700))
    m._evicted.update(rng.sample(range(1, 60), rng.randrange(0, 4)))
    starts = [rng.randrange(0, 30) for _ in range(3)]
    ids = tuple([rng.choice([0, *range(1, 60)]) for _ in range(rng.randrange(0, 12))] for _ in range(3))
    lazy = m._blocks(ids, held, starts)
    now = m._blocks(ids, held, starts).blocks  # read at once
    built = tuple(
        _hashed_blocks(group, m._hash_view(held, g, starts[g], group)) for g, group in enumerate(ids)
    )
    assert now == built or not any(ids)
    hashes.append(rng.randbytes(32))  # vLLM goes on: another hash, more tokens cached,
    held.hashed_tokens += 64
    m._evicted.update(b for group in ids for b in group[:2])  # blocks evicted,
    hashes[:] = [rng.randbytes(32) for _ in hashes]  # the request reset and hashed anew
    assert lazy.get_block_ids() == tuple(list(g) for g in ids) or not any(ids)
    assert lazy.blocks == now


def test_blocks_holding_no_hash_yet_are_built_from_their_ids_alone() -> None:
    """A step's new block past the request's hashed tokens (a decode step's) is answered
    as its ids alone (no closure made for it): read, the same blocks, with no hash, that
    the hashed path builds; a block within the hashed tokens still gets its hash."""
    from kvcoord.client.vllm_types import KVCacheBlock

    m = object.__new__(KVCoordKVCacheManager)
    m.enable_caching, m.hash_block_size, m._evicted = True, 16, set()
    m.block_sizes, m._positional = [16], [True]
    m.empty_kv_cache_blocks = KVCacheBlocks(((),))
    hashes = [bytes([i]) * 32 for i in range(2)]
    held = _Held(types.SimpleNamespace(block_hashes=hashes), 32)  # two blocks hashed
    lazy = m._blocks(([7],), held, [2])  # the table's third block
    assert lazy._make is None and lazy._blocks is None
    assert lazy.get_block_ids() == ([7],)
    assert lazy.blocks == ([KVCacheBlock(7)],) == (_hashed_blocks([7], m._hash_view(held, 0, 2, [7])),)
    assert m._blocks(([7],), held, [1]).blocks == ([KVCacheBlock(7, hashes[1] + bytes(4))],)
    assert KVCacheBlocks(ids=((3, 0), ())).blocks == ([KVCacheBlock(3), KVCacheBlock(0)], [])


def test_a_runs_answer_matches_only_the_mirrors_blocks() -> None:
    """``ColumnRun.matches`` (made by C passes over the entries) takes the server's answer
    only when it gives every entry, in order, the mirror's blocks of every group."""
    from kvcoord.client.items import ColumnRun

    run = ColumnRun()
    given = [((), (7,)), ((3, 4), ()), ((), ()), ((9,), (10, 11))]
    for i, new in enumerate(given):
        run.fixed += (f"r{i}", 4, 1, 4, 1, 0, 1, 0)
        run.tokens.append(5)
        run.news.append(new)

    def answer(groups: list[tuple[int, ...]], kind: type = pb.AllocateRunResult) -> Any:
        out = kind()
        out.num_new_blocks.extend(len(g) for g in groups)
        out.new_block_ids.extend(b for g in groups for b in g)
        return out

    mirror = [g for new in given for g in new]
    assert run.matches(answer(mirror))
    decode = answer(mirror, pb.DecodeResult)
    decode.num_applied = len(given)
    assert run.matches(decode)
    moved = [*mirror[:2], (4,), (3,), *mirror[4:]]  # the same ids, another entry's
    other = [*mirror[:-1], (10, 12)]
    assert not any(run.matches(answer(a)) for a in (moved, other, mirror[:-1], [*mirror, ()]))
    decode.refused.append(2)
    assert not run.matches(decode)


@pytest.mark.parametrize("piece_ops", [0, 2])
def test_a_decode_step_taking_a_block_is_the_run_entry_add_to_run_makes(piece_ops: int) -> None:
    """``StepGathering.add_step`` (a decode step taking or caching a block: its token and
    hash appended as they are) gathers exactly the runs ``add_to_run`` gathers from the
    same step given as one-element tuples: the same columns, answers, sizes and runs cut
    at the server's ``max_ops_per_step``."""
    from kvcoord.client.gathering import StepGathering
    from kvcoord.client.items import Gathered

    def gathering() -> StepGathering:
        g = StepGathering()
        g.pending, g.run, g.backlog = Gathered(), None, 0
        g.client = types.SimpleNamespace(step_piece_ops=piece_ops)  # type: ignore[assignment]
        return g

    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    steps: list[tuple[Any, ...]] = [
        ("a", 16, 1, 17, None, 15, 1, 0, ((4,),)),
        ("b", 32, 1, 3, h1, 31, 1, 2, ((),)),
        ("c", 48, 2, 2**32 - 1, h2, 47, 1, 0, ((9,),)),
        ("a", 17, 1, 5, None, 16, 1, 0, ((5,),)),
        ("d", 64, 3, 0, h1, 63, 1, 1, ((6,),)),
    ]
    general, direct = gathering(), gathering()
    for rid, base_t, base_h, token, h, computed, num_new, ahead, new in steps:
        general.add_to_run(
            rid, base_t, base_h, (token,), () if h is None else (h,), computed, num_new, ahead, new
        )
        direct.add_step(rid, base_t, base_h, token, h, computed, num_new, ahead, new)
    general.close_run()
    direct.close_run()
    assert len(direct.pending.runs) == len(general.pending.runs) == (3 if piece_ops else 1)
    assert direct.pending.size == general.pending.size
    for (_, a), (_, b) in zip(general.pending.runs, direct.pending.runs, strict=True):
        assert (b.fixed, b.tokens, b.hashes, b.news, b.size) == (a.fixed, a.tokens, a.hashes, a.news, a.size)
        ops = pb.AllocateRunOp(), pb.AllocateRunOp()
        a.write(ops[0])
        b.write(ops[1])
        assert ops[0] == ops[1]


class _View:
    """vLLM's ``ConstantList``: a read-only view of the request's own token list, which
    vLLM appends to and cuts in place (every ``len()`` and slice a Python call)."""

    def __init__(self, x: list[int]) -> None:
        self._x = x

    def __len__(self) -> int:
        return len(self._x)

    def __getitem__(self, i: Any) -> Any:
        return self._x[i]

    def __iter__(self) -> Any:
        return iter(self._x)


def test_token_list_is_the_list_behind_a_view_only() -> None:
    tokens = [1, 2, 3]
    assert token_list(types.SimpleNamespace(all_token_ids=_View(tokens))) is tokens
    for other in (tokens, tuple(tokens), _View(tuple(tokens)), range(3)):  # read as they are
        assert token_list(types.SimpleNamespace(all_token_ids=other)) is None


@pytest.mark.parametrize("seed", range(10))
def test_a_running_requests_tokens_are_read_in_place_as_its_view_gives_them(seed: int) -> None:
    """``sync_run`` reads the list behind vLLM's view of a registered request's tokens
    in place: whatever vLLM does (tokens appended or cut in place, computed tokens
    moved, another request object under the id), each run entry and refusal is what
    reading the view itself gives (a twin request whose tokens are a plain list, read
    as they are), and a registration's prompt is a copy vLLM's changes do not reach."""
    rng = random.Random(seed)
    trackers = [RequestTracker(pb.PoolConfig(enable_caching=False), b"") for _ in range(2)]
    lists = [[rng.randrange(1000) for _ in range(rng.randrange(1, 40))]]
    lists.append(list(lists[0]))
    reqs = [
        types.SimpleNamespace(request_id="r", all_token_ids=_View(lists[0]), num_computed_tokens=0),
        types.SimpleNamespace(request_id="r", all_token_ids=lists[1], num_computed_tokens=0),
    ]
    first = [t.sync_values(r) for t, r in zip(trackers, reqs, strict=True)]
    prompt = list(lists[1])
    for _ in range(60):
        action = rng.random()
        if action < 0.6:  # a decode (or a few tokens)
            new = [rng.randrange(1000) for _ in range(rng.choice((1, 1, 1, 3)))]
            for x in lists:
                x += new
        elif action < 0.7:  # cut in place (a streaming session's update)
            k = rng.randrange(len(lists[0]) + 1)
            for x in lists:
                del x[k:]
        elif action < 0.8:  # another object under the id, with its own tokens
            tokens = [rng.randrange(1000) for _ in range(len(lists[0]) + rng.randrange(0, 4))]
            lists = [tokens, list(tokens)]
            reqs = [
                types.SimpleNamespace(request_id="r", all_token_ids=_View(lists[0]), num_computed_tokens=0),
                types.SimpleNamespace(request_id="r", all_token_ids=lists[1], num_computed_tokens=0),
            ]
        computed = rng.randrange(len(lists[0]) + 1)
        got = []
        for t, r in zip(trackers, reqs, strict=True):
            r.num_computed_tokens = computed
            try:
                got.append(t.sync_run(r))
            except KVCoordError as err:
                got.append(type(err))
        assert got[0] == got[1]
    assert list(first[0].tokens) == list(first[1].tokens) == prompt  # not vLLM's list itself


@pytest.mark.parametrize("view", [False, True], ids=["list", "constant-list"])
def test_a_registrations_source_tokens_are_the_list_it_copied(view: bool) -> None:
    """The tracker hands the mirror's check the plain list a registration's
    :class:`HandedTokenIds` was copied from (vLLM's own, behind its view or not), and
    nothing once registered; a source of another length is not read (a copy is)."""
    tracker = RequestTracker(pb.PoolConfig(enable_caching=False), b"")
    raw = list(range(40))
    tokens: Any = raw
    if view:

        class _View:
            def __init__(self, x: list[int]) -> None:
                self._x = x

            def __len__(self) -> int:
                return len(self._x)

            def __getitem__(self, i: Any) -> Any:
                return self._x[i]

        tokens = _View(raw)
    request = types.SimpleNamespace(request_id="r", all_token_ids=tokens, num_computed_tokens=0)
    values = tracker.sync_values(request)
    assert type(values.tokens) is HandedTokenIds and values.source_tokens is raw
    assert wire_tokens("r", values.tokens, values.source_tokens) is values.tokens
    raw.append(7)
    assert tracker.sync_values(request).source_tokens is None
    bad = HandedTokenIds([True, *range(39)])
    assert type(wire_tokens("r", bad, list(range(41)))) is list  # (length differs: its own copy, refused)
