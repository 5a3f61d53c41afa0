"""A DecodeOp's packed columns (the ``packed_*`` fields) read as the same columns as
its repeated fields: the same operation, answers and pool as the AllocateOps they stand
for; a malformed packed column or a message in both forms is refused, loudly."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kvcoord.engine import FullAttentionSpec, SlidingWindowSpec
from kvcoord.service import operations as op
from kvcoord.service.convert import operation_from_pb
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import WireError
from kvcoord.wire.columns import pack_uint32, packed_decode_columns, unpack_uint32, write_packed_decode
from unit import test_decode_op
from unit.test_decode_op import Driver

#: DecodeOp's repeated columns (fields 1-10)
COLUMNS = (
    "request_ids", "base_num_tokens", "base_num_hashes", "num_computed_tokens", "num_new_tokens",
    "num_lookahead_tokens", "num_append_tokens", "append_token_ids", "num_append_hashes", "append_block_hashes",
)  # fmt: skip


class Repeated:
    """A repeated-form DecodeOp's columns, written as the client's ColumnRun writes its own."""

    def __init__(self, d: pb.DecodeOp) -> None:
        self.d = d

    def write(self, into: Any) -> None:
        for name in COLUMNS:
            getattr(into, name).extend(getattr(self.d, name))


def packed(d: pb.DecodeOp) -> pb.DecodeOp:
    out = pb.DecodeOp(must_succeed=d.must_succeed)
    write_packed_decode(out, Repeated(d))
    return out


def read(d: pb.DecodeOp) -> op.Operation:
    """``d`` as the server reads it (from its bytes)."""
    return operation_from_pb(pb.Operation.FromString(pb.Operation(decode=d).SerializeToString()), 1)


def sample() -> pb.DecodeOp:
    return pb.DecodeOp(
        request_ids=["a", "b", "c"],
        base_num_tokens=[7, 70000, 2**32 - 1],
        base_num_hashes=[1, 4375, 3],
        num_computed_tokens=[7, 70000, 5],
        num_new_tokens=[1, 1, 3],
        num_lookahead_tokens=[0, 2, 0],
        num_append_tokens=[1, 0, 2],
        append_token_ids=[300, 151_000, 0],
        num_append_hashes=[1, 0, 1],
        append_block_hashes=[b"h" * 32, b"k" * 32],
        must_succeed=True,
    )


def test_the_packed_form_reads_as_the_repeated_one() -> None:
    d = sample()
    p = packed(d)
    assert not any(len(getattr(p, name)) for name in COLUMNS[1:])  # fields 2-10 empty
    assert p.packed_hash_length == 32 and p.packed_append_block_hashes == b"h" * 32 + b"k" * 32
    assert read(p) == read(d)
    got, want = read(p), read(d)
    assert isinstance(got, op.Decode) and isinstance(want, op.Decode)
    for name in COLUMNS:  # the same values, of the same types (the engine checks Counts / TokenIds by type)
        assert [type(x) for x in getattr(got, name)] == [type(x) for x in getattr(want, name)]
        assert type(getattr(got, name)) is type(getattr(want, name)), name


def test_packed_values_are_little_endian_uint32() -> None:
    assert pack_uint32([1, 258, 2**32 - 1]) == b"\x01\x00\x00\x00\x02\x01\x00\x00\xff\xff\xff\xff"
    assert unpack_uint32(b"\x01\x00\x00\x00\x00\x00\x01\x00", "x") == [1, 65536]
    assert sample().base_num_tokens[2] == read(packed(sample())).base_num_tokens[2]  # type: ignore[attr-defined]
    with pytest.raises(OverflowError):
        pack_uint32([2**32])


@pytest.mark.parametrize("other", [b"k" * 31, b""])
def test_hashes_of_different_lengths_or_empty_are_sent_repeated(other: bytes) -> None:
    """Only the repeated form carries hashes of several lengths, or empty ones: the
    client writes it."""
    d = sample()
    d.append_block_hashes[1] = other
    p = packed(d)
    assert not p.packed_append_block_hashes and not p.packed_base_num_tokens
    assert p == d
    d.append_block_hashes[0] = other  # all of one length: packed, unless empty
    assert (packed(d) == d) == (not other)


def test_an_empty_run_is_read_as_no_entries() -> None:
    p = packed(pb.DecodeOp())
    assert p == pb.DecodeOp()
    assert packed_decode_columns(p) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("packed_base_num_tokens", b"\x01\x00\x00", "packed_base_num_tokens is 3 bytes, not a whole number"),
        ("packed_append_token_ids", b"\x00" * 13, "packed_append_token_ids is 13 bytes"),
        ("packed_num_append_hashes", b"\x00" * 5, "packed_num_append_hashes is 5 bytes"),
        (
            "packed_append_block_hashes",
            b"h" * 33,
            "33 bytes, not a whole number of hashes of packed_hash_length (32)",
        ),
        ("packed_hash_length", 0, "64 bytes, not a whole number of hashes of packed_hash_length (0)"),
    ],
)
def test_a_packed_column_not_a_whole_number_of_values_is_refused(
    field: str, value: object, message: str
) -> None:
    p = packed(sample())
    setattr(p, field, value)
    with pytest.raises(WireError, match=re.escape(message)):
        read(p)


@pytest.mark.parametrize("column", COLUMNS[1:])
def test_a_message_in_both_forms_is_refused(column: str) -> None:
    p = packed(sample())
    getattr(p, column).append(b"x" * 32 if column == "append_block_hashes" else 1)
    with pytest.raises(WireError, match="in one form, packed .* or repeated .*, not both"):
        read(p)


@pytest.mark.parametrize(
    "column", ["packed_base_num_tokens", "packed_num_new_tokens", "packed_num_append_hashes"]
)
def test_packed_columns_of_other_lengths_change_nothing(column: str) -> None:
    """A whole number of values, but not one per entry: the Decode's own check (as for
    the repeated form), nothing applied."""
    p = packed(sample())
    setattr(p, column, getattr(p, column) + b"\x00" * 4)
    pool = test_decode_op.make((FullAttentionSpec(test_decode_op.BS),), 20)
    s = pool.attach("sha256_cbor", test_decode_op.BS, "0", "test", 0)
    before = pool.engine.snapshot()
    (out,) = pool.apply(s, [read(p)])  # type: ignore[list-item]
    assert out.error is not None and not isinstance(out.error, op.DecodeFailed)
    assert "one value per entry" in out.error.message or "add up" in out.error.message
    assert pool.engine.snapshot() == before


#: test_decode_op's own (the repeated form's)
as_decode = test_decode_op.as_decode


def as_packed_decode(allocs: list[pb.AllocateOp], must_succeed: bool) -> op.Decode:
    """test_decode_op's ``as_decode`` with the columns sent packed; the same operation
    as the repeated form's."""
    repeated = as_decode(allocs, must_succeed)
    d = pb.DecodeOp(**{name: getattr(repeated, name) for name in COLUMNS}, must_succeed=must_succeed)
    p = packed(d)
    assert p.packed_base_num_tokens and not p.base_num_tokens
    got = read(p)
    assert got == read(d) == repeated
    assert isinstance(got, op.Decode)
    return got


@pytest.mark.parametrize(
    ("groups", "num_blocks"),
    [
        ((FullAttentionSpec(test_decode_op.BS),), 12),  # small: refusals
        ((FullAttentionSpec(test_decode_op.BS), SlidingWindowSpec(test_decode_op.BS, 8)), 40),
    ],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_packed_decode_ops_answer_as_their_allocate_ops(
    groups: tuple[object, ...], num_blocks: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_decode_op's random Steps (refusals, wrong positions, other sessions', unknown
    requests, bad hashes and counts, look-ahead, must_succeed, reservations) with the
    DecodeOps packed: the same answers, pool state and events as the AllocateOps."""
    monkeypatch.setattr(test_decode_op, "as_decode", as_packed_decode)
    d = Driver(groups, num_blocks, seed, reserve=seed == 2)
    for _ in range(60):
        d.step()
    assert d.runs > 10 and d.failed > 10
