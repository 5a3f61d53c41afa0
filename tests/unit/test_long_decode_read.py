"""A long DecodeOp read in slices (long_syncs.decode_in_slices) gives what convert.py
reads at once: the same Decode, or the same error."""

from __future__ import annotations

from typing import Any

import pytest
from kvcoord.service.convert import operation_from_pb
from kvcoord.service.errors import ServiceError
from kvcoord.service.long_syncs import LONG_DECODE_ENTRIES, decode_in_slices
from kvcoord.service.pool_types import drain
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire.columns import pack_uint32
from kvcoord.wire.errors import WireError

N = LONG_DECODE_ENTRIES + 3000


def _columns(n: int) -> dict[str, list[int]]:
    return {
        "base_num_tokens": [4 + i % 7 for i in range(n)],
        "base_num_hashes": [1] * n,
        "num_computed_tokens": [4] * n,
        "num_new_tokens": [1 + i % 2 for i in range(n)],
        "num_lookahead_tokens": [i % 3 for i in range(n)],
        "num_append_tokens": [1 + i % 2 for i in range(n)],
        "num_append_hashes": [i % 2 for i in range(n)],
    }


def _decode(packed: bool, n: int = N, hashed: bool = True, **broken: Any) -> pb.Operation:
    cols = _columns(n)
    if not hashed:
        cols["num_append_hashes"] = [0] * n
    tokens = list(range(sum(cols["num_append_tokens"])))
    hashes = [bytes([i % 251]) * 32 for i in range(sum(cols["num_append_hashes"]))]
    ids = [f"r{i}" for i in range(n)]
    if packed:
        d = pb.DecodeOp(
            request_ids=ids, packed_append_token_ids=pack_uint32(tokens),
            packed_append_block_hashes=b"".join(hashes), packed_hash_length=32 if hashed else 0, must_succeed=True,
            **{f"packed_{k}": pack_uint32(v) for k, v in cols.items()},  # type: ignore[arg-type]
        )  # fmt: skip
    else:
        d = pb.DecodeOp(
            request_ids=ids,
            append_token_ids=tokens,
            append_block_hashes=hashes,
            **cols,  # type: ignore[arg-type]
        )
    for name, value in broken.items():
        setattr(d, name, value)
    return pb.Operation(decode=d)


@pytest.mark.parametrize("hashed", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_the_same_decode_in_slices(packed: bool, hashed: bool) -> None:
    o = _decode(packed, hashed=hashed)
    work = decode_in_slices(o, 1)
    slices = 0
    while True:
        try:
            next(work)
            slices += 1
        except StopIteration as done:
            assert done.value == operation_from_pb(o, 1)
            break
    assert slices > 8  # (read in slices indeed)


@pytest.mark.parametrize(
    "broken",
    [
        {"packed_num_new_tokens": b"\0\0\0"},
        {"packed_append_block_hashes": b"\0" * 33},
        {"packed_hash_length": 0},
    ],
)
def test_the_same_error_at_once(broken: dict[str, Any]) -> None:
    o = _decode(True, **broken)
    with pytest.raises((ServiceError, WireError)) as at_once:
        operation_from_pb(o, 1)
    with pytest.raises((ServiceError, WireError)) as sliced:
        drain(decode_in_slices(o, 1))
    assert (type(sliced.value), str(sliced.value)) == (type(at_once.value), str(at_once.value))


def test_both_forms_the_same_error() -> None:
    o = _decode(True)
    o.decode.base_num_tokens.append(1)
    with pytest.raises((ServiceError, WireError)) as at_once:
        operation_from_pb(o, 1)
    with pytest.raises((ServiceError, WireError)) as sliced:
        drain(decode_in_slices(o, 1))
    assert (type(sliced.value), str(sliced.value)) == (type(at_once.value), str(at_once.value))
