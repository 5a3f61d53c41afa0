"""How a tracker reads a request's lists: vLLM's token list behind its read-only view,
and block hashes as ``bytes`` (:mod:`.tracking`'s helpers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcoord.engine import BytesHashes, InvalidArgumentError

__all__ = ["as_bytes", "token_list"]


def token_list(request: Any) -> list[int] | None:
    """The list behind vLLM's read-only ``ConstantList`` view of a request's tokens
    (``all_token_ids``, whose every ``len()`` and slice is a Python call; vLLM makes the
    view once and only appends to or cuts its list in place), to read in place; ``None``
    when ``all_token_ids`` is a list itself (read as cheaply) or any other sequence."""
    tokens = request.all_token_ids
    if type(tokens) is list:
        return None
    inner = getattr(tokens, "_x", None)
    return inner if type(inner) is list else None


def as_bytes(hashes: Sequence[Any]) -> BytesHashes:
    """``hashes`` as a list of exact ``bytes`` (vLLM's are ``bytes`` already: then one C
    pass checks it), marked :class:`BytesHashes` so that the engine, which keeps them,
    does not make the same type pass again (their count and lengths it still checks).

    Raises:
        InvalidArgumentError: a hash that is not a bytes-like buffer (``bytes(5)`` would
            be five zero bytes: an int must never become some other block's hash).
    """
    out = hashes if type(hashes) is list else list(hashes)
    if list(map(type, out)).count(bytes) != len(out):
        out = [_exact_bytes(h) for h in out]
    return BytesHashes(out)


def _exact_bytes(h: Any) -> bytes:
    """``h`` (bytes, a subclass of it, bytearray, memoryview: any buffer) as an exact
    ``bytes``; anything else refused as the engine refuses it."""
    try:
        return bytes(memoryview(h))
    except TypeError:
        raise InvalidArgumentError("block hashes must be non-empty bytes") from None
