"""A journal record is encoded as cbor2 encodes it, a large bytes field copied once
(journal_cbor.py)."""

from __future__ import annotations

import cbor2
import pytest
from kvcoord.service.journal_cbor import LARGE_FIELD_BYTES, cbor_head, record_bytes

SIZES = [0, 1, 23, 24, 255, 256, 65_535, 65_536, 70_000]


@pytest.mark.parametrize("n", SIZES)
def test_heads_are_cbor2s(n: int) -> None:
    assert cbor_head(2, n) + b"x" * n == cbor2.dumps(b"x" * n)
    assert cbor_head(4, n) + b"\x00" * n == cbor2.dumps([0] * n)


def test_long_heads() -> None:
    assert cbor_head(2, 1 << 32) == b"\x5b" + (1 << 32).to_bytes(8, "big")
    assert cbor_head(4, (1 << 32) - 1) == b"\x9a\xff\xff\xff\xff"


@pytest.mark.parametrize("n", [LARGE_FIELD_BYTES - 1, LARGE_FIELD_BYTES, 3 << 20])
def test_records_are_cbor2s(n: int) -> None:
    body = bytes(range(256)) * (n // 256) + b"z" * (n % 256)
    fields = (
        "call",
        1_700_000_000.25,
        "Step",
        body,
        "key",
        b"\x01" * 32,
        None,
        b"\x02" * 32,
        [1, "a"],
        {"k": 2},
    )
    assert record_bytes(fields) == cbor2.dumps(list(fields))
    assert record_bytes((*fields, body)) == cbor2.dumps([*fields, body])
