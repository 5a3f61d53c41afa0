"""A journal record's CBOR encoding, without cbor2's copies of a large bytes field.

``cbor2.dumps`` of a record holding a Step's 15 MB body held the event loop 15-25 ms
(its output buffer grows and is copied as it fills). :func:`record_bytes` gives the
same bytes: each small field encoded by cbor2 on its own, a large bytes field as its
CBOR head followed by the bytes themselves, joined once (one copy); a field already
encoded (:class:`Encoded`: a pool's state a handover brought, pool_load.py) as its
bytes. Plain Python; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import cbor2

__all__ = ["LARGE_FIELD_BYTES", "Encoded", "cbor_head", "record_bytes"]

#: a bytes field at least this long is copied into the record as it is
LARGE_FIELD_BYTES = 1 << 16

_BYTES = 2  # CBOR major types
_ARRAY = 4


class Encoded(bytes):
    """One CBOR item's encoding, put in a record as it is (not a bytes field)."""


def cbor_head(major: int, n: int) -> bytes:
    """The head of a CBOR item of major type ``major`` with argument ``n`` (its length,
    or its count of items), in the shortest form, as every CBOR encoder writes it."""
    top = major << 5
    if n < 24:
        return bytes((top | n,))
    if n < 1 << 8:
        return bytes((top | 24, n))
    if n < 1 << 16:
        return bytes((top | 25,)) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes((top | 26,)) + n.to_bytes(4, "big")
    return bytes((top | 27,)) + n.to_bytes(8, "big")


def record_bytes(fields: Sequence[object]) -> bytes:
    """``cbor2.dumps(list(fields))``, byte for byte, a large bytes field copied once, an
    :class:`Encoded` field standing for the item it encodes."""
    if not any((type(f) is bytes and len(f) >= LARGE_FIELD_BYTES) or type(f) is Encoded for f in fields):
        return cbor2.dumps(list(fields))
    parts = [cbor_head(_ARRAY, len(fields))]
    for f in fields:
        if type(f) is Encoded:
            parts.append(f)
        elif type(f) is bytes and len(f) >= LARGE_FIELD_BYTES:
            parts.append(cbor_head(_BYTES, len(f)))
            parts.append(f)
        else:
            parts.append(cbor2.dumps(f))
    return b"".join(parts)
