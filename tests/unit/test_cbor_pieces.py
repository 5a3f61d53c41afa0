"""cbor_pieces: a value decoded, encoded and let go in pieces is cbor2's, byte for byte
and value for value, whatever its shape (the walked containers and the ones decoded at
once alike)."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest
from kvcoord.service.cbor_pieces import dumps_in_pieces, loads_in_pieces, release_in_pieces
from kvcoord.service.registry_state import dump_pool
from test_reservation_leases_travel import _reserved

SHAPES: list[Any] = [
    0,
    "x",
    b"\x00" * 70_000,
    [],
    {},
    [[1, [2, [3, [4, [5, [6]]]]]]] * 300,  # deeper than walked, long
    {"a": {"b": {"c": {"d": {"e": {"f": [[1, 2]] * 300}}}}}},
    [[i, b"h" * 32, [i] * 5, None, 1.5, -7] for i in range(1000)],
    {1: [[-1, "t"]] * 257, -2: {"k": [{"n": [i]} for i in range(300)]}},
    [{"x": i} for i in range(300)] + [5, "mixed", [6]],
]


@pytest.mark.parametrize("value", SHAPES, ids=range(len(SHAPES)))
def test_pieces_are_cbor2s(value: Any) -> None:
    data = cbor2.dumps(value)
    assert dumps_in_pieces(value) == data
    assert loads_in_pieces(data) == cbor2.loads(data)


def test_a_pools_state_in_pieces() -> None:
    registry, _, _ = _reserved(20.0)
    value = dump_pool(registry, "p", leases=True)
    data = cbor2.dumps(value)
    assert dumps_in_pieces(value) == data
    got = loads_in_pieces(data)
    assert got == cbor2.loads(data)
    release_in_pieces(got)
    assert got == {}


def test_what_cbor2_decodes_its_own_way_is_decoded_by_it() -> None:
    """An array key (cbor2 makes it a tuple), a tag, and indefinite lengths."""
    keyed = b"\xa1\x82\x01\x02\x63abc"  # {[1, 2]: "abc"}
    assert loads_in_pieces(keyed) == cbor2.loads(keyed) == {(1, 2): "abc"}
    tagged = cbor2.dumps([cbor2.CBORTag(4000, [1, 2])] * 3)
    assert loads_in_pieces(tagged) == cbor2.loads(tagged)
    indefinite = b"\x9f\x9f\x01\xff\xbf\x61a\x02\xff\xff"  # [_ [_ 1], {_ "a": 2}]
    assert loads_in_pieces(indefinite) == cbor2.loads(indefinite) == [[1], {"a": 2}]


@pytest.mark.parametrize("data", [b"", b"\x82\x01", cbor2.dumps([1]) + b"\x00"])
def test_not_one_cbor_value_is_refused(data: bytes) -> None:
    with pytest.raises(cbor2.CBORDecodeError):
        loads_in_pieces(data)


def test_release_leaves_what_others_hold() -> None:
    shared = [b"kept"] * 3
    value = {"pool": {"engine": {"rows": [[1, shared]] * 300}}}
    release_in_pieces(value)
    assert value == {} and shared == [b"kept"] * 3
