"""Keyed calls this process gave up on, named in their session's next keyed calls.

A keyed call (Allocate, Free, Step) whose retries ran out without telling whether it
was applied ends in :class:`~kvcoord.client.errors.OutcomeUnknownError` (an asyncio
caller cancelling one in flight leaves it as unknown: ``aio.AsyncKVCoordClient._call``
records it here the same way); its caller then
treats its requests as lost (the waiting-mode manager frees them, ``if_held``, in the same
session, and vLLM may admit a request again under the same id). If the server never saw
the call, a copy held back on the way could still arrive after that, and be applied: a
late Allocate registering a request again (cache entries for KV nobody writes), a late
Free freeing the blocks of the request admitted again. So each such call's key and
``call_sequence`` are kept here, per session, and every keyed call of the session built
afterwards names them (``abandoned``, the newest :data:`MAX_NAMED`) until a call naming
them is answered: the server then keeps a tombstone for each key it does not hold, and
the late delivery is refused (ANSWER_EVICTED), never applied. The call that frees the
lost requests is such a later call, so it is ordered after the tombstones.

One record per process (calls of a session may go through several clients, as call
numbers are per process: ``_requests.sequence``). A session's record goes when a Detach
of it is answered or a call of it is told the session is gone.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb

from .errors import KVCoordError, OutcomeUnknownError, SessionExpiredError

__all__ = ["MAX_NAMED", "MAX_SENT", "MAX_SESSIONS", "answered", "failed", "given_up", "name_on"]

#: the most calls one request names (the server refuses more: bounds.py)
MAX_NAMED = 256
#: sessions with a record at most (the oldest record goes past it: a session whose end
#: this process never learned, e.g. its Detach unanswered, whose lease ended it since)
MAX_SESSIONS = 4096
#: the RPCs whose requests carry ``abandoned``
KEYED = frozenset(("Allocate", "Free", "Step"))

#: keyed calls sent, newest last, whose list is kept (a call sent again past it may be
#: refused KEY_REUSED when calls were given up on since: loud, never applied twice)
MAX_SENT = 4096

_lock = threading.Lock()
#: (session id, key) -> what the call named when first sent, for the calls sent last
_SENT: collections.OrderedDict[tuple[str, str], tuple[tuple[str, int], ...]] = collections.OrderedDict()
#: session id -> {idempotency key: call_sequence} of its calls given up on, oldest first
_given_up: dict[str, dict[str, int]] = {}


def given_up(session_id: str) -> dict[str, int]:
    """The calls of ``session_id`` given up on and not yet named by an answered call."""
    with _lock:
        return dict(_given_up.get(session_id, {}))


def name_on(rpc: str, request: Any) -> list[str]:
    """Before a call's first attempt: name its session's calls given up on in its
    ``abandoned`` (not its own key: a caller sending it again), and return their keys.
    A call's body is its idempotency key's, so a call sent again under its key names
    what it named when first sent (:data:`_SENT`: a caller sending the same request
    again, a Step in pieces rebuilt with the same piece keys); a request that names some
    already is left as it is."""
    if rpc not in KEYED or not request.session_id:
        return []
    if request.abandoned:
        return [c.idempotency_key for c in request.abandoned]
    sent = (request.session_id, request.idempotency_key)
    with _lock:
        named = _SENT.get(sent) if request.idempotency_key else None
        if named is None:
            calls = _given_up.get(request.session_id, {})
            named = tuple((k, n) for k, n in calls.items() if k != request.idempotency_key)[-MAX_NAMED:]
            if request.idempotency_key:
                _SENT[sent] = named
                if len(_SENT) > MAX_SENT:
                    _SENT.popitem(last=False)
        else:
            _SENT.move_to_end(sent)
    request.abandoned.extend(pb.AbandonedCall(idempotency_key=k, call_sequence=n) for k, n in named)
    return [k for k, _ in named]


def answered(rpc: str, request: Any, named: list[str]) -> None:
    """The call was answered: the server holds tombstones for the calls it named (and
    the call's own outcome is known); a Detach ends its session's record."""
    session_id = getattr(request, "session_id", "")
    if not session_id or (rpc not in KEYED and rpc != "Detach"):
        return
    with _lock:
        if rpc == "Detach":
            _given_up.pop(session_id, None)
            return
        calls = _given_up.get(session_id)
        if calls is None:
            return
        for key in (*named, request.idempotency_key):
            calls.pop(key, None)
        if not calls:
            del _given_up[session_id]


def failed(rpc: str, request: Any, err: KVCoordError) -> None:
    """The call failed with ``err``: remember it when its outcome is unknown (keyed
    calls); forget the session's record when the session is gone (its late copies are
    refused for their session: NOT_FOUND)."""
    session_id = getattr(request, "session_id", "")
    if not session_id:
        return
    with _lock:
        if isinstance(err, SessionExpiredError):
            _given_up.pop(session_id, None)
        elif isinstance(err, OutcomeUnknownError) and rpc in KEYED and request.idempotency_key:
            calls = _given_up.setdefault(session_id, {})
            if len(_given_up) > MAX_SESSIONS:
                del _given_up[next(iter(_given_up))]
            calls.pop(request.idempotency_key, None)  # (sent again and given up again: newest)
            calls[request.idempotency_key] = request.call_sequence
