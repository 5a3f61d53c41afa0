"""A long request sync's tokens and block hashes read from the wire in slices.

Reading the 1,048,576 tokens of one AllocateOp into the engine's list (one int object
each) held the event loop 30-90 ms in one call (convert.sync_from_pb). An AllocateOp
with at least :data:`LONG_SYNC_TOKENS` tokens is read here instead:
:data:`TOKENS_SLICE` tokens and :data:`HASHES_SLICE` block hashes at a time (yielding
between slices), the rest of the operation by convert.py as before, from a copy of it
without them; the result is the one :func:`convert.allocate_from_pb` gives. The tokens
are handed to the engine (:class:`~kvcoord.engine.HandedTokenIds`: it keeps the list
read here instead of copying it, 7-18 ms for 1,048,576 tokens). Plain Python; no gRPC,
no I/O.
"""

from __future__ import annotations

from collections.abc import Generator

from kvcoord.engine import HandedTokenIds
from kvcoord.v1 import allocator_pb2 as pb

from . import operations as op
from .bounds import fields_of
from .convert import allocate_from_pb

__all__ = ["LONG_SYNC_TOKENS", "TOKENS_SLICE", "allocate_in_slices", "is_long"]

#: an AllocateOp with at least this many tokens to append is read in slices
LONG_SYNC_TOKENS = 131_072
#: tokens read between two yields (a few milliseconds)
TOKENS_SLICE = 32_768
#: block hashes read between two yields (a bytes object made for each)
HASHES_SLICE = 8_192


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
