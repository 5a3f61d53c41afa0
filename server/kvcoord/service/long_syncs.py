"""A long request sync's tokens and block hashes read from the wire in slices.

Reading the 1,048,576 tokens of one AllocateOp into the engine's list (one int object
each) held the event loop 30-90 ms in one call (convert.sync_from_pb). An AllocateOp
with at least :data:`LONG_SYNC_TOKENS` tokens is read here instead:
:data:`TOKENS_SLICE` tokens and :data:`HASHES_SLICE` block hashes at a time (yielding
between slices), the rest of the operation by convert.py as before, from a copy of it
without them; the result is the one :func:`convert.allocate_from_pb` gives. The tokens
are handed to the engine (:class:`~kvcoord.engine.HandedTokenIds`: it keeps the list
read here instead of copying it, 7-18 ms for 1,048,576 tokens). A DecodeOp of more than
:data:`LONG_DECODE_ENTRIES` entries has its columns read here the same way
(:func:`decode_in_slices`). Plain Python; no gRPC, no I/O.
"""

from __future__ import annotations

from collections.abc import Generator

from kvcoord.engine import Counts, HandedTokenIds, TokenIds
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire.columns import unpack_uint32

from . import operations as op
from .bounds import fields_of
from .convert import allocate_from_pb, operation_from_pb

__all__ = [
    "LONG_DECODE_ENTRIES",
    "LONG_SYNC_TOKENS",
    "TOKENS_SLICE",
    "allocate_in_slices",
    "decode_in_slices",
    "is_long",
    "is_long_decode",
]

#: an AllocateOp with at least this many tokens to append is read in slices
LONG_SYNC_TOKENS = 131_072
#: tokens read between two yields (a few milliseconds)
TOKENS_SLICE = 32_768
#: block hashes read between two yields (a bytes object made for each)
HASHES_SLICE = 8_192
#: a DecodeOp of more entries is read in slices (65,536 entries at once: 16-30 ms)
LONG_DECODE_ENTRIES = 4_096
#: the values of a DecodeOp's column read between two yields
DECODE_SLICE_VALUES = 8_192


def is_long(a: pb.AllocateOp) -> bool:
    """Whether ``a`` appends at least LONG_SYNC_TOKENS tokens."""
    return len(a.request.append_token_ids) >= LONG_SYNC_TOKENS


def allocate_in_slices(a: pb.AllocateOp, num_groups: int) -> Generator[None, None, op.Allocate]:
    """``allocate_from_pb(a, num_groups)``, a long operation's tokens read a slice at a
    time (yielding before each).

    Raises:
        ServiceError: as allocate_from_pb, before anything else was read.
    """
    if not is_long(a):
        return allocate_from_pb(a, num_groups)
    # (a copy with CopyFrom copied the tokens too: tens of milliseconds)
    shell = fields_of(a, lambda fd: fd.name != "request")
    shell.request.CopyFrom(fields_of(a.request, lambda fd: fd.name not in _READ_HERE))
    out = allocate_from_pb(shell, num_groups)  # (its checks first)
    wire = a.request.append_token_ids
    tokens = HandedTokenIds()
    for k in range(0, len(wire), TOKENS_SLICE):
        yield
        tokens += wire[k : k + TOKENS_SLICE]
    wire_hashes = a.request.append_block_hashes
    hashes: list[bytes] = []
    for k in range(0, len(wire_hashes), HASHES_SLICE):
        yield
        hashes += wire_hashes[k : k + HASHES_SLICE]
    out.sync.append_token_ids = tokens  # nothing here keeps it: the engine may keep it as it is
    out.sync.append_block_hashes = hashes
    return out


_READ_HERE = ("append_token_ids", "append_block_hashes")


#: a DecodeOp's columns of one value per entry, then its appended tokens
_DECODE_COLUMNS = (
    "base_num_tokens", "base_num_hashes", "num_computed_tokens", "num_new_tokens", "num_lookahead_tokens",
    "num_append_tokens", "append_token_ids", "num_append_hashes",
)  # fmt: skip


def is_long_decode(o: pb.Operation) -> bool:
    """Whether ``o`` is a DecodeOp of more than LONG_DECODE_ENTRIES entries."""
    return o.WhichOneof("op") == "decode" and len(o.decode.request_ids) > LONG_DECODE_ENTRIES


def decode_in_slices(o: pb.Operation, num_groups: int) -> Generator[None, None, op.Operation]:
    """``convert.operation_from_pb``'s Decode of ``o``, a DecodeOp of more than
    LONG_DECODE_ENTRIES entries read DECODE_SLICE_VALUES values (HASHES_SLICE hashes) of
    a column at a time, yielding before each: the same value. One that convert.py would
    refuse (both forms, a packed column not a whole number of values or hashes) is read
    by it at once, for the same error; so is a short one."""
    d = o.decode
    names = {f.name for f, _ in d.ListFields()}
    packed = any(n.startswith("packed_") for n in names)
    blob, length = d.packed_append_block_hashes, d.packed_hash_length
    malformed = packed and (
        any(n in names for n in _DECODE_COLUMNS + ("append_block_hashes",))
        or any(len(getattr(d, "packed_" + n)) % 4 for n in _DECODE_COLUMNS)
        or (blob and (not length or len(blob) % length))
    )
    if malformed or not is_long_decode(o):
        return operation_from_pb(o, num_groups)
    rids: list[str] = []
    for k in range(0, len(d.request_ids), DECODE_SLICE_VALUES):
        yield
        rids += d.request_ids[k : k + DECODE_SLICE_VALUES]
    cols: list[list[int]] = []
    for name in _DECODE_COLUMNS:
        values: list[int] = []
        if packed:
            data, step = getattr(d, "packed_" + name), 4 * DECODE_SLICE_VALUES
            for k in range(0, len(data), step):
                yield
                values += unpack_uint32(data[k : k + step], "packed_" + name)
        else:
            wire = getattr(d, name)
            for k in range(0, len(wire), DECODE_SLICE_VALUES):
                yield
                values += wire[k : k + DECODE_SLICE_VALUES]
        cols.append(values)
    hashes: list[bytes] = []
    if packed and blob:
        for k in range(0, len(blob), length * HASHES_SLICE):
            yield
            hashes += [
                blob[j : j + length] for j in range(k, min(len(blob), k + length * HASHES_SLICE), length)
            ]
    elif not packed:
        for k in range(0, len(d.append_block_hashes), HASHES_SLICE):
            yield
            hashes += d.append_block_hashes[k : k + HASHES_SLICE]
    base_t, base_h, computed, new, look, num_t, tokens, num_h = cols
    return op.Decode(
        rids, base_t, base_h, Counts(computed), Counts(new), Counts(look), num_t, TokenIds(tokens), Counts(num_h),
        hashes, d.must_succeed,
    )  # fmt: skip
