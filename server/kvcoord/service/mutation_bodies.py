"""A mutating call's bytes: its request serialized and digested (its idempotency key's
digest, its journal record) and its answer's repeated results serialized, in slices a
large Step does not hold the event loop for (mutations.py runs them between turns)."""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from typing import Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from .bounds import fields_of

__all__ = [
    "DIGEST_SLICE_BYTES",
    "abandoned_calls",
    "body_digest",
    "joined",
    "keyed_body_slices",
    "repeated_slices",
    "request_digest",
    "serialized_slices",
    "small_body",
    "take_events_budget",
]

#: bytes of a large Step's body hashed (its key's digest) at once
DIGEST_SLICE_BYTES = 1 << 20


def request_digest(request: Message) -> bytes:
    """What binds an idempotency key to its request: a hash of the whole request (the
    key included, which a retry repeats unchanged)."""
    return body_digest(request.SerializeToString(deterministic=True))


def serialized_slices(request: Message, every: int) -> Generator[None, None, bytes]:
    """``request.SerializeToString(deterministic=True)``, a Step's operations serialized
    ``every`` at a time (yielding between slices): its fields in field-number order,
    the operations' bytes where their field's number puts them. A request of at most
    ``every`` operations, or one with top-level fields this code does not know, is
    serialized at once."""
    body = small_body(request, every)
    if body is not None:
        return body
    parts = yield from repeated_slices(request, "ops", every)
    return joined(request, "ops", parts)


def small_body(request: Message, every: int) -> bytes | None:
    """``request.SerializeToString(deterministic=True)`` when :func:`serialized_slices`
    serializes it at once (None: in slices)."""
    fields = request.DESCRIPTOR.fields_by_name
    if "ops" not in fields or len(request.ops) <= every or len(UnknownFieldSet(request)):  # type: ignore[attr-defined]
        return request.SerializeToString(deterministic=True)
    return None


def repeated_slices(message: Message, name: str, every: int) -> Generator[None, None, list[bytes]]:
    """The encoding of ``message``'s repeated message field ``name``, ``every`` entries
    at a time (yielding before each): a repeated field's encoding is the concatenation
    of its entries' (tag, length, bytes)."""
    items = getattr(message, name)
    parts = []
    for k in range(0, len(items), every):
        yield
        parts.append(type(message)(**{name: items[k : k + every]}).SerializeToString(deterministic=True))
    return parts


def joined(message: Message, name: str, parts: list[bytes]) -> bytes:
    """``message`` serialized (deterministically: no field of ours is a map, so as
    ``SerializeToString()`` too) with ``parts`` (:func:`repeated_slices`) as the encoding
    of its field ``name``: the fields numbered below it, the parts, the fields above."""
    number = message.DESCRIPTOR.fields_by_name[name].number
    low = fields_of(message, lambda fd: fd.number < number).SerializeToString(deterministic=True)
    high = fields_of(message, lambda fd: fd.number > number).SerializeToString(deterministic=True)
    return b"".join([low, *parts, high])


def keyed_body_slices(
    request: Message, every: int, body: bytes | None = None
) -> Generator[None, None, tuple[bytes, bytes]]:
    """The request serialized (:func:`serialized_slices`; ``body``: serialized already)
    and its :func:`body_digest`, hashed DIGEST_SLICE_BYTES at a time (a 15 MB body took
    20-30 ms at once). A body of one slice or less is hashed without a yield: each yield
    is a turn of the event loop (a decode Step's 10 kB took one turn more than it needed)."""
    if body is None:
        body = yield from serialized_slices(request, every)
    if len(body) <= DIGEST_SLICE_BYTES:
        return body, body_digest(body)
    h = hashlib.blake2b(digest_size=16)
    view = memoryview(body)
    for k in range(0, len(body), DIGEST_SLICE_BYTES):
        yield
        h.update(view[k : k + DIGEST_SLICE_BYTES])
    return body, h.digest()


def body_digest(body: bytes) -> bytes:
    """:func:`request_digest` of a request serialized deterministically as ``body``."""
    return hashlib.blake2b(body, digest_size=16).digest()


def take_events_budget(max_message_bytes: int) -> int | None:
    """The byte budget of a TakeEventsOp's events: half an answer (None: no budget)."""
    return max_message_bytes // 2 if max_message_bytes else None


def abandoned_calls(request: Any) -> list[tuple[str, int]]:
    """The (idempotency key, call sequence number) of each call a keyed request names as
    given up on by its client (``abandoned``: idempotency.py)."""
    return [(c.idempotency_key, c.call_sequence) for c in request.abandoned]
