"""A large request parsed a slice at a time, without a protocol change.

gRPC's deserializer parses a request in one protobuf call: 120-210 ms of the event
loop for a 14.7 MB Step. The servicer takes a Step's bytes as they came instead
(servicer.add_servicer) and parses them here: a request under :data:`PARSE_AT_ONCE_BYTES`
at once; a larger one by scanning its top-level fields (tag and length varints) and
merging them into the message :data:`PARSE_SLICE_BYTES` or so at a time with
``MergeFromString``, yielding between slices. Protobuf defines parsing the
concatenation of two encodings as merging the second into the first (a repeated
field appends, a message field merges, a scalar's last value wins, unknown fields are
kept in order, a packed field's runs are concatenated), and every cut falls between two
fields, so the result is ``FromString(data)`` exactly. A field larger than a slice
(one operation registering a 1,048,576-token request: 4 MB) is entered the same way:
a message field's fields merged into it a slice at a time, a packed field's values a
slice at a time (cut between two values, each slice sent as a run of its own). Bytes the scan cannot follow (a bad varint, a length past
the end, a group, a field number 0) are parsed at once, so their error is the one
``FromString`` raises. Plain Python and asyncio; no gRPC, no I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from contextvars import ContextVar
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

__all__ = [
    "PARSED",
    "PARSE_AT_ONCE_BYTES",
    "PARSE_SLICE_BYTES",
    "encode_varint",
    "parse_in_turns",
    "parse_slices",
]

M = TypeVar("M", bound=Message)

#: the request :func:`parse_in_turns` parsed last in this task (interceptors are given
#: the bytes: the access log reads its pool and session here)
PARSED: ContextVar[Message | None] = ContextVar("kvcoord_parsed_request", default=None)
#: a request of fewer bytes is parsed in one call (a few milliseconds at most)
PARSE_AT_ONCE_BYTES = 256 << 10
#: about how many bytes are parsed between two yields (a field larger is parsed whole)
PARSE_SLICE_BYTES = 64 << 10


def _varint(data: memoryview, i: int, end: int) -> tuple[int, int]:
    """The varint at ``data[i]`` and the index after it; ValueError past ``end`` or
    past 10 bytes."""
    value = shift = 0
    while i < end and shift < 70:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
    raise ValueError("bad varint")


def _field_end(data: memoryview, i: int, end: int) -> int:
    """The index after the top-level field starting at ``data[i]``; ValueError when
    the scan cannot follow it (the whole is then parsed at once)."""
    tag, i = _varint(data, i, end)
    kind = tag & 7
    if tag >> 3 == 0:
        raise ValueError("field number 0")
    if kind == 0:
        _, i = _varint(data, i, end)
        return i
    if kind == 1:
        i += 8
    elif kind == 2:
        size, i = _varint(data, i, end)
        i += size
    elif kind == 5:
        i += 4
    else:  # a group (3, 4) or no wire type (6, 7)
        raise ValueError("wire type")
    if i > end:
        raise ValueError("past the end")
    return i


def parse_slices(cls: type[M], data: bytes, slice_bytes: int = PARSE_SLICE_BYTES) -> Generator[None, None, M]:
    """``cls.FromString(data)``, yielding after about every ``slice_bytes`` bytes
    merged (at once below :data:`PARSE_AT_ONCE_BYTES`).

    Raises:
        google.protobuf.message.DecodeError: as ``cls.FromString(data)`` does.
    """
    if len(data) < PARSE_AT_ONCE_BYTES:
        return cls.FromString(data)
    message = cls()
    try:
        yield from _merge(message, memoryview(data), 0, len(data), slice_bytes)
    except (ValueError, DecodeError):
        # bytes the scan cannot follow, or a field that does not parse: the whole
        # parsed at once, for the error FromString gives (or its answer)
        return cls.FromString(data)
    return message


def _merge(
    message: Message, view: memoryview, i: int, end: int, slice_bytes: int
) -> Generator[None, None, None]:
    """Merge the fields in ``view[i:end]`` into ``message`` a slice at a time: each
    slice is merged into what came before (protobuf parses a concatenation of
    encodings as their merge), every cut between two fields; a field larger than a
    slice is merged a slice at a time itself (:func:`_merge_field`)."""
    start = i
    fields = 0
    while i < end:
        at = i
        i = _field_end(view, i, end)
        fields += 1
        if i - at > slice_bytes:
            if start < at:
                message.MergeFromString(view[start:at])  # type: ignore[arg-type]  # (a buffer)
                yield
            yield from _merge_field(message, view, at, i, slice_bytes)
            start = i
        elif i - start >= slice_bytes or i == end:
            message.MergeFromString(view[start:i])  # type: ignore[arg-type]
            start = i
            yield
        elif not fields % 1024:
            yield


_VARINT_TYPES = frozenset(
    (
        FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM,
    )
)  # fmt: skip


def _merge_field(
    message: Message, view: memoryview, i: int, end: int, slice_bytes: int
) -> Generator[None, None, None]:
    """Merge the one large field ``view[i:end]`` into ``message``: a message field's
    own fields a slice at a time into that message (a repeated one: into a new last
    element), a packed varint field's values a slice at a time (cut between two values:
    a packed field given in several runs is their concatenation); anything else (a map
    entry, a string, other packed fields) at once."""
    tag, k = _varint(view, i, end)
    _, j = _varint(view, k, end)
    head = bytes(view[i:k])
    fd = message.DESCRIPTOR.fields_by_number.get(tag >> 3) if tag & 7 == 2 else None
    if fd is not None and fd.type == FieldDescriptor.TYPE_MESSAGE and j < end and not _map_entry(fd):
        value = getattr(message, fd.name)
        # (a message field sent twice is merged: a singular one, or a oneof's, is
        # given the fields of every occurrence, as one parse does)
        target = value.add() if fd.is_repeated else value
        yield from _merge(target, view, j, end, slice_bytes)  # (not empty: its presence set)
        return
    if fd is not None and fd.is_repeated and fd.type in _VARINT_TYPES:
        while j < end:
            cut = min(j + slice_bytes, end)
            while cut < end and view[cut - 1] >= 0x80:  # inside a varint: to its end
                cut += 1
            message.MergeFromString(head + encode_varint(cut - j) + bytes(view[j:cut]))
            j = cut
            yield
        return
    message.MergeFromString(view[i:end])  # type: ignore[arg-type]


def _map_entry(fd: Any) -> bool:
    return fd.message_type is not None and bool(fd.message_type.GetOptions().map_entry)


def encode_varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint (convert.py's and score_wire.py's hand-encoded
    answers use it too)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


async def parse_in_turns(cls: type[M], data: bytes, seconds: float, pause: float) -> M:
    """:func:`parse_slices` on the event loop: at most about ``seconds`` of parsing at
    once, then ``pause`` seconds for other calls.

    Raises:
        google.protobuf.message.DecodeError: as ``cls.FromString(data)`` does.
    """
    if len(data) < PARSE_AT_ONCE_BYTES:  # (as parse_slices would: at once, without a generator)
        message = cls.FromString(data)
        PARSED.set(message)
        return message
    work = parse_slices(cls, data)
    end = time.perf_counter() + seconds
    while True:
        try:
            next(work)
        except StopIteration as done:
            PARSED.set(done.value)
            return done.value  # type: ignore[no-any-return]
        if time.perf_counter() >= end:
            await asyncio.sleep(pause)
            end = time.perf_counter() + seconds
