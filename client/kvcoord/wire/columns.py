"""A DecodeOp's packed columns (see the proto's DecodeOp ``packed_*`` fields): integer
columns as little-endian uint32 arrays, the appended block hashes as one concatenation
of hashes of one length. Written here once for both sides: the client packs
(:func:`write_packed_decode`), the server unpacks (:func:`packed_decode_columns`), each
column in one call instead of one value at a time.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Protocol

from kvcoord.engine import Counts, TokenIds
from kvcoord.v1 import allocator_pb2 as pb

from .errors import WireError

__all__ = [
    "PACKED_WIDTH",
    "PackedColumns",
    "pack_uint32",
    "packed_decode_columns",
    "unpack_uint32",
    "write_packed_decode",
]

#: bytes per packed value (uint32)
PACKED_WIDTH = 4
#: the array type code of a uint32 on this machine
_CODE = next(code for code in "IL" if array(code).itemsize == PACKED_WIDTH)
#: the wire is little-endian; a big-endian machine swaps each value
_SWAP = sys.byteorder != "little"

_FIELDS = pb.DecodeOp.DESCRIPTOR.fields_by_name
#: fields 2-10: the repeated form of the columns
_REPEATED = frozenset(
    _FIELDS[name].number
    for name in (
        "base_num_tokens", "base_num_hashes", "num_computed_tokens", "num_new_tokens", "num_lookahead_tokens",
        "num_append_tokens", "append_token_ids", "num_append_hashes", "append_block_hashes",
    )
)  # fmt: skip
#: the packed form's fields
_PACKED = frozenset(f.number for f in pb.DecodeOp.DESCRIPTOR.fields if f.name.startswith("packed_"))

#: the columns of a DecodeOp as the engine reads them (request_ids, base tokens, base
#: hashes, computed, new, look-ahead, appended token counts, tokens, appended hash
#: counts, hashes): :class:`~kvcoord.engine.DecodeColumns`'s fields, in order
PackedColumns = tuple[
    Sequence[str], list[int], list[int], Counts, Counts, Counts, list[int], TokenIds, Counts, list[bytes]
]


def pack_uint32(values: Sequence[int]) -> bytes:
    """``values`` as little-endian uint32s (OverflowError past 2**32 - 1, or below 0)."""
    a = array(_CODE, values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack_uint32(data: bytes, name: str) -> list[int]:
    """The little-endian uint32s in ``data`` (column ``name``, for the error).

    Raises:
        WireError: when ``data``'s length is not a multiple of 4.
    """
    return _uint32_array(data, name).tolist()


def _uint32_array(data: bytes, name: str) -> array[int]:
    """:func:`unpack_uint32`'s values as an ``array``: a ``list`` subclass is made from it
    in one pass (``Counts(array)``), where one from ``tolist()`` is a second copy."""
    if len(data) % PACKED_WIDTH:
        raise WireError(
            f"decode: {name} is {len(data)} bytes, not a whole number of uint32 values ({PACKED_WIDTH} bytes each)"
        )
    a = array(_CODE, data)
    if _SWAP:
        a.byteswap()
    return a


def packed_decode_columns(d: pb.DecodeOp) -> PackedColumns | None:
    """``d``'s columns when it gives them packed, else ``None`` (the repeated form, or
    no columns at all: the caller reads fields 2-10). Only checks what packing adds (a
    whole number of values, one form); the caller checks that the columns have one
    value per entry and add up, as for the repeated form.

    Raises:
        WireError: both forms in one message, a column not a whole number of uint32s,
            hashes without a length or not a whole number of hashes of it.
    """
    fields = {f.number for f, _ in d.ListFields()}
    if _PACKED.isdisjoint(fields):
        return None
    if not _REPEATED.isdisjoint(fields):
        raise WireError(
            "decode: a DecodeOp gives its columns in one form, packed (packed_*) or repeated (fields 2-10), not both"
        )
    blob = d.packed_append_block_hashes
    length = d.packed_hash_length
    if blob and (not length or len(blob) % length):
        raise WireError(
            f"decode: packed_append_block_hashes is {len(blob)} bytes, not a whole number of hashes of "
            f"packed_hash_length ({length}) bytes"
        )
    base, computed = d.packed_base_num_tokens, d.packed_num_computed_tokens
    base_num_tokens = unpack_uint32(base, "packed_base_num_tokens")
    return (
        d.request_ids[:],
        base_num_tokens,
        unpack_uint32(d.packed_base_num_hashes, "packed_base_num_hashes"),
        # (a decode step's computed counts are its base token counts: the same bytes)
        Counts(base_num_tokens)
        if computed == base
        else Counts(_uint32_array(computed, "packed_num_computed_tokens")),
        Counts(_uint32_array(d.packed_num_new_tokens, "packed_num_new_tokens")),
        Counts(_uint32_array(d.packed_num_lookahead_tokens, "packed_num_lookahead_tokens")),
        unpack_uint32(d.packed_num_append_tokens, "packed_num_append_tokens"),
        TokenIds(_uint32_array(d.packed_append_token_ids, "packed_append_token_ids")),
        Counts(_uint32_array(d.packed_num_append_hashes, "packed_num_append_hashes")),
        [blob[k : k + length] for k in range(0, len(blob), length)] if blob else [],
    )


class _Writes(Protocol):
    """What writes a run's columns (the client's ColumnRun): each column's values
    ``extend``ed onto the attribute of its DecodeOp field's name."""

    def write(self, op: Any) -> None: ...


@dataclasses.dataclass(slots=True)
class _ColumnLists:
    """The columns a :class:`_Writes` writes, as lists (named as DecodeOp's fields)."""

    request_ids: list[str] = dataclasses.field(default_factory=list)
    base_num_tokens: list[int] = dataclasses.field(default_factory=list)
    base_num_hashes: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)
    num_new_tokens: list[int] = dataclasses.field(default_factory=list)
    num_lookahead_tokens: list[int] = dataclasses.field(default_factory=list)
    num_append_tokens: list[int] = dataclasses.field(default_factory=list)
    append_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_append_hashes: list[int] = dataclasses.field(default_factory=list)
    append_block_hashes: list[bytes] = dataclasses.field(default_factory=list)


def write_packed_decode(d: pb.DecodeOp, run: _Writes) -> None:
    """``run``'s columns written into ``d`` in the packed form; in the repeated form
    when its appended hashes are not all of one length, or are empty (which only that
    form carries: the server then answers them as it answers any such hash)."""
    c = _ColumnLists()
    run.write(c)
    hashes = c.append_block_hashes
    if len(set(map(len, hashes))) > 1 or (hashes and not hashes[0]):
        run.write(d)
        return
    d.request_ids.extend(c.request_ids)
    d.packed_base_num_tokens = pack_uint32(c.base_num_tokens)
    d.packed_base_num_hashes = pack_uint32(c.base_num_hashes)
    d.packed_num_computed_tokens = pack_uint32(c.num_computed_tokens)
    d.packed_num_new_tokens = pack_uint32(c.num_new_tokens)
    d.packed_num_lookahead_tokens = pack_uint32(c.num_lookahead_tokens)
    d.packed_num_append_tokens = pack_uint32(c.num_append_tokens)
    d.packed_append_token_ids = pack_uint32(c.append_token_ids)
    d.packed_num_append_hashes = pack_uint32(c.num_append_hashes)
    if hashes:
        d.packed_append_block_hashes = b"".join(hashes)
        d.packed_hash_length = len(hashes[0])
