"""A large CBOR value decoded and encoded in pieces, none of which holds the GIL long.

``cbor2.loads`` and ``cbor2.dumps`` are single calls into cbor2's C code, which never
lets the GIL go: a pool's state of 262,144 blocks (26 MiB) took 0.5 s to decode and
0.26 s to encode, 1,048,576 blocks 2.6 s and 1.5 s, and while one ran no other thread
ran, the event loop included, wherever the call was made. :func:`loads_in_pieces` and
:func:`dumps_in_pieces` give the same value and the same bytes, but walk the outer
containers of the value in Python and leave to cbor2 only their elements (one block's
entry, one request, one event): a thread running them lets the loop take the GIL at
every switch interval. Which containers are walked is decided by shape, not by name:
maps near the top, and arrays of containers (an array of scalars, a request's tokens,
is decoded at once: its cost per byte is small).
"""

from __future__ import annotations

import io
from typing import Any

import cbor2

from .journal_cbor import cbor_head

__all__ = ["dumps_in_pieces", "loads_in_pieces", "release_in_pieces"]

#: maps this deep or shallower are walked (the state's maps are 5 deep at most)
MAP_DEPTH = 4
#: an array of containers this deep or shallower is walked whatever its length
ARRAY_DEPTH = 3
#: a deeper array of containers is walked from this many elements
LONG_ARRAY = 256

_UINT, _NINT, _BYTES, _TEXT, _ARRAY, _MAP = range(6)


class _Whole(Exception):
    """The container cannot be walked (an indefinite length, a key that is not a
    scalar): it is decoded at once."""


def loads_in_pieces(data: bytes) -> Any:
    """``cbor2.loads(data)``, its outer containers walked (see the module docstring).

    Raises:
        cbor2.CBORDecodeError: not CBOR, or bytes left after the value.
        ValueError: as cbor2.
    """
    fp = io.BytesIO(data)  # (shares ``data``: no copy)
    decoder = cbor2.CBORDecoder(fp)
    value = _item(fp, decoder, 0)
    if fp.tell() != len(data):
        raise cbor2.CBORDecodeError(f"{len(data) - fp.tell()} bytes after the CBOR value")
    return value


def _head(fp: io.BytesIO) -> tuple[int, int]:
    """The next item's major type and argument (its count or length); raises
    :class:`_Whole` for an indefinite length, and for an item that is not a definite
    array or map (the caller decodes those itself)."""
    first = fp.read(1)
    if not first:
        raise cbor2.CBORDecodeError("premature end of CBOR data")
    major, info = first[0] >> 5, first[0] & 31
    if major not in (_ARRAY, _MAP) or info > 27:
        raise _Whole
    if info < 24:
        return major, info
    size = 1 << (info - 24)
    raw = fp.read(size)
    if len(raw) != size:
        raise cbor2.CBORDecodeError("premature end of CBOR data")
    return major, int.from_bytes(raw, "big")


def _peek_container(fp: io.BytesIO) -> bool:
    """Whether the next item is an array or a map (the position is kept)."""
    at = fp.tell()
    first = fp.read(1)
    fp.seek(at)
    return bool(first) and first[0] >> 5 in (_ARRAY, _MAP)


def _item(fp: io.BytesIO, decoder: cbor2.CBORDecoder, depth: int) -> Any:
    start = fp.tell()
    try:
        major, count = _head(fp)
        if major == _MAP:
            if depth > MAP_DEPTH:
                raise _Whole
            out: dict[Any, Any] = {}
            for _ in range(count):
                key_at = fp.tell()
                if _peek_container(fp):  # (cbor2 makes such a key immutable: decoded whole)
                    raise _Whole
                fp.seek(key_at)
                key = decoder.decode()
                out[key] = _item(fp, decoder, depth + 1)
            return out
        if count and (depth <= ARRAY_DEPTH or count >= LONG_ARRAY) and _peek_container(fp):
            return [_item(fp, decoder, depth + 1) for _ in range(count)]
        raise _Whole
    except _Whole:
        fp.seek(start)
        return decoder.decode()


def dumps_in_pieces(value: Any) -> bytes:
    """``cbor2.dumps(value)`` byte for byte (for plain values: dicts, lists, tuples,
    scalars), its outer containers walked alike."""
    parts: list[bytes] = []
    _dump(value, 0, parts)
    return b"".join(parts)


def _dump(value: Any, depth: int, parts: list[bytes]) -> None:
    if type(value) is dict and depth <= MAP_DEPTH and all(type(k) in (str, int) for k in value):
        parts.append(cbor_head(_MAP, len(value)))
        for key, item in value.items():
            parts.append(cbor2.dumps(key))
            _dump(item, depth + 1, parts)
        return
    if (
        type(value) in (list, tuple)
        and value
        and (depth <= ARRAY_DEPTH or len(value) >= LONG_ARRAY)
        and type(value[0]) in (list, tuple, dict)
    ):
        parts.append(cbor_head(_ARRAY, len(value)))
        for item in value:
            _dump(item, depth + 1, parts)
        return
    parts.append(cbor2.dumps(value))


def release_in_pieces(value: Any) -> None:
    """Empty ``value`` (a value :func:`loads_in_pieces` made, which nothing else uses
    any more) a piece at a time, its outer containers walked alike: its last reference
    dropped at once freed its millions of objects in one cascade of C calls, the GIL
    held throughout (as long as decoding it took). Its scalars, which others may hold,
    are only let go."""
    _release(value, 0)


def _release(value: Any, depth: int) -> None:
    if type(value) is dict and depth <= MAP_DEPTH:
        while value:
            _release(value.popitem()[1], depth + 1)
    elif (
        type(value) is list
        and value
        and (depth <= ARRAY_DEPTH or len(value) >= LONG_ARRAY)
        and type(value[0]) in (list, tuple, dict)
    ):
        while value:
            _release(value.pop(), depth + 1)
