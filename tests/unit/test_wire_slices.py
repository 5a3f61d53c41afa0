"""A request parsed in slices (wire_slices.py) is ``FromString`` of its bytes, and a
large Step's body and answer serialized in slices (mutations.py) are the one-shot
serializations, byte for byte."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcoord.service import mutation_bodies, mutations, wire_slices
from kvcoord.service.wire_slices import parse_in_turns, parse_slices
from kvcoord.v1 import allocator_pb2 as pb
from support import drive

KINDS = [f.name for f in pb.Operation.DESCRIPTOR.oneofs_by_name["op"].fields]


def _operation(kind: str, rid: str, tokens: list[int]) -> pb.Operation:
    o = pb.Operation()
    part = getattr(o, kind)
    part.SetInParent()
    if kind == "allocate":
        part.request.request_id = rid
        part.request.append_token_ids.extend(tokens)
        part.num_new_tokens = len(tokens)
    elif "request_id" in part.DESCRIPTOR.fields_by_name:
        part.request_id = rid
    return o


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


UNKNOWN = [
    _varint(99 << 3 | 0) + _varint(12345),  # a varint
    _varint(100 << 3 | 2) + _varint(3) + b"abc",  # length-delimited
    _varint(101 << 3 | 1) + bytes(8),  # fixed64
    _varint(102 << 3 | 5) + bytes(4),  # fixed32
]

operations = st.lists(
    st.tuples(st.sampled_from(KINDS), st.text(max_size=5), st.lists(st.integers(0, 2**32 - 1), max_size=40)),
    max_size=60,
)


@st.composite
def step_bytes(draw: Any) -> bytes:
    """A StepRequest's encoding: its fields in any order, some repeated (a scalar's last
    value wins, a message field merges), unknown fields between them."""
    fields = [pb.StepRequest(ops=[_operation(k, r, t)]).SerializeToString() for k, r, t in draw(operations)]
    fields += [
        pb.StepRequest(pool=draw(st.text(max_size=8))).SerializeToString(),
        pb.StepRequest(session_id=draw(st.text(max_size=8))).SerializeToString(),
        pb.StepRequest(idempotency_key=draw(st.text(max_size=8))).SerializeToString(),
        pb.StepRequest(include_state=draw(st.booleans())).SerializeToString(),
        pb.StepRequest(fence=pb.Fence(instance_id=draw(st.text(max_size=4)))).SerializeToString(),
        pb.StepRequest(fence=pb.Fence(position=draw(st.integers(0, 2**40)))).SerializeToString(),
        *draw(st.lists(st.sampled_from(UNKNOWN), max_size=4)),
    ]
    return b"".join(draw(st.permutations(fields)))


@pytest.fixture
def slice_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire_slices, "PARSE_AT_ONCE_BYTES", 0)


@settings(max_examples=150, deadline=None)
@given(data=step_bytes(), slice_bytes=st.integers(1, 400))
def test_a_step_parsed_in_slices_is_its_bytes_parsed_at_once(data: bytes, slice_bytes: int) -> None:
    once = pb.StepRequest.FromString(data)
    saved = wire_slices.PARSE_AT_ONCE_BYTES
    wire_slices.PARSE_AT_ONCE_BYTES = 0  # (hypothesis runs the examples in one test call)
    try:
        sliced, _ = drive(parse_slices(pb.StepRequest, data, slice_bytes))
    finally:
        wire_slices.PARSE_AT_ONCE_BYTES = saved
    assert sliced == once
    assert sliced.SerializeToString() == once.SerializeToString()  # unknown fields kept, in order


@settings(max_examples=150, deadline=None)
@given(data=step_bytes(), cut=st.integers(0, 10_000), junk=st.binary(max_size=6))
def test_bytes_that_do_not_parse_fail_as_they_do_at_once(data: bytes, cut: int, junk: bytes) -> None:
    bad = data[: cut % (len(data) + 1)] + junk
    try:
        once: Any = pb.StepRequest.FromString(bad)
    except DecodeError:
        once = DecodeError
    saved = wire_slices.PARSE_AT_ONCE_BYTES
    wire_slices.PARSE_AT_ONCE_BYTES = 0
    try:
        sliced: Any = drive(parse_slices(pb.StepRequest, bad, 16))[0]
    except DecodeError:
        sliced = DecodeError
    finally:
        wire_slices.PARSE_AT_ONCE_BYTES = saved
    assert sliced == once


def _large_step(n: int) -> pb.StepRequest:
    return pb.StepRequest(
        pool="p",
        session_id="s",
        idempotency_key="k",
        fence=pb.Fence(instance_id="o", position=7),
        ops=[_operation(KINDS[i % len(KINDS)], f"r{i}", [i % 97] * 80) for i in range(n)],
    )


def test_a_large_step_is_parsed_in_many_slices_and_an_empty_one_at_once() -> None:
    data = _large_step(60_000).SerializeToString()
    assert len(data) > wire_slices.PARSE_AT_ONCE_BYTES
    parsed, yields = drive(parse_slices(pb.StepRequest, data))
    assert parsed == pb.StepRequest.FromString(data)
    assert yields >= len(data) // wire_slices.PARSE_SLICE_BYTES
    assert drive(parse_slices(pb.StepRequest, b"")) == (pb.StepRequest(), 0)


def test_other_tasks_run_between_the_slices_of_a_parse(slice_everything: None) -> None:
    data = _large_step(2_000).SerializeToString()

    async def main() -> tuple[pb.StepRequest, int]:
        ticks = 0
        parsing = True

        async def other() -> None:
            nonlocal ticks
            for _ in range(1_000_000):  # (bounded; ends with the parse)
                if not parsing:
                    return
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        ticks = 0
        parsed = await parse_in_turns(pb.StepRequest, data, 0.0, 0.0)
        parsing = False
        await task
        return parsed, ticks

    parsed, ticks = asyncio.run(main())
    assert parsed == pb.StepRequest.FromString(data)
    assert ticks >= len(data) // wire_slices.PARSE_SLICE_BYTES


@settings(max_examples=60, deadline=None)
@given(ops=operations, every=st.integers(1, 7))
def test_a_step_serialized_and_hashed_in_slices_is_serialized_and_hashed_at_once(
    ops: Any, every: int
) -> None:
    request = pb.StepRequest(
        pool="p", session_id="s", idempotency_key="k", fence=pb.Fence(instance_id="o"), include_state=True,
        ops=[_operation(k, r, t) for k, r, t in ops],
    )  # fmt: skip
    body, digest = drive(mutation_bodies.keyed_body_slices(request, every))[0]
    assert body == request.SerializeToString(deterministic=True)
    assert digest == mutation_bodies.request_digest(request)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), every=st.integers(1, 7), events=st.integers(0, 3), more=st.booleans())
def test_an_answer_serialized_in_slices_is_serialized_at_once(
    n: int, every: int, events: int, more: bool
) -> None:
    answer = pb.StepResponse(
        results=[
            pb.OperationResult(allocate=pb.AllocateResult(new_block_ids=[pb.BlockIds(block_ids=[i, i + 1])]))
            if i % 2
            else pb.OperationResult(status_code=i)
            for i in range(n)
        ],
        num_free_blocks=n,
        usage=0.25,
        fence=pb.Fence(instance_id="o", position=n),
        events=[pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()) for _ in range(events)],
        events_more=more,
    )
    parts = drive(mutation_bodies.repeated_slices(answer, "results", every))[0]
    assert mutation_bodies.joined(answer, "results", parts) == answer.SerializeToString()


@pytest.mark.parametrize("body_bytes", [0, 10_000, mutation_bodies.DIGEST_SLICE_BYTES - 200])
def test_a_keyed_body_of_one_slice_is_digested_without_a_turn_of_the_loop(body_bytes: int) -> None:
    """Each yield of the keyed call's serializing is a turn of the event loop (an
    ``await asyncio.sleep(0)`` in MutationRunner.run): a decode Step's 10 kB took one
    turn that did nothing but let others run for a few microseconds."""
    request = pb.StepRequest(pool="p", session_id="s", idempotency_key="k" * 32)
    if body_bytes:
        request.ops.add().free.request_id = "r" * body_bytes
    (body, digest), yields = drive(mutation_bodies.keyed_body_slices(request, mutations.SERIALIZE_SLICE_OPS))
    assert yields == 0
    assert body == request.SerializeToString(deterministic=True)
    assert digest == mutation_bodies.request_digest(request)


def test_a_keyed_body_past_one_slice_is_still_digested_a_slice_at_a_time() -> None:
    request = pb.StepRequest(pool="p", session_id="s", idempotency_key="k" * 32)
    request.ops.add().free.request_id = "r" * (2 * mutation_bodies.DIGEST_SLICE_BYTES + 1)
    (body, digest), yields = drive(mutation_bodies.keyed_body_slices(request, mutations.SERIALIZE_SLICE_OPS))
    assert yields == 3
    assert digest == mutation_bodies.request_digest(request)


def test_one_large_operation_is_parsed_in_slices_too() -> None:
    """A Step of one operation registering a long request (one 4 MB top-level field at
    1,048,576 tokens) is entered: its tokens (a packed field) and hashes merged a slice
    at a time."""
    sync = pb.RequestSync(
        request_id="r", new_request=True, append_token_ids=[(k * 7919) % 200_000 for k in range(300_000)],
        append_block_hashes=[k.to_bytes(4, "big") * 8 for k in range(300_000 // 16)],
    )  # fmt: skip
    request = pb.StepRequest(
        pool="p", ops=[pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=5))]
    )
    request.ops.add().free.request_id = "x"
    data = request.SerializeToString()
    parsed, yields = drive(parse_slices(pb.StepRequest, data))
    assert parsed == request and parsed.SerializeToString() == data
    assert yields >= len(data) // wire_slices.PARSE_SLICE_BYTES
