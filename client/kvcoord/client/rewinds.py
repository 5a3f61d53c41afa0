"""Rewinds: a registered request cut back since its last sync.

vLLM 0.33 edits a waiting streaming-input session in place when its next input chunk
arrives (``Scheduler._update_request_as_session``): its last sampled token is
discarded (``del _all_token_ids[num_tokens - 1:]``, never a computed one), its block
hashes from that position's block on are dropped, the chunk's tokens are appended and
the hashes of the blocks now full computed again. The request keeps its blocks. The
token and hash lists a :class:`~.tracking.RequestTracker` reads from their sent length
on cannot show that cut: the tracker keeps, per position sent, the last token and hash
then sent (:func:`note`), and at the next sync compares them with the request's own
(:func:`changed`, constant time). A request that changed is rewound
(``RequestSync.rewind_num_tokens``) to its computed-token count: what lies below it
never changes (its KV is written), what lies past it is sent again, so the server's
record (and the predicting mode's mirror) becomes the request's again, whatever the cut
(:func:`rewind_point`). A change the rewind cannot cover (a computed position) is
refused loudly, never sent as if nothing had happened. The cut also grows the request's
``num_prompt_tokens`` (the whole session becomes its prompt), even where it changed
nothing sent (the discarded token never was): the tracker sends the new length with
the next sync (``RequestSync.num_prompt_tokens``), whatever :func:`changed` says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from .errors import InvalidArgumentError

__all__ = [
    "FIRST_LAST",
    "changed",
    "forget_after",
    "keep_note",
    "new_seen",
    "note",
    "note_token",
    "rewind_point",
    "seen_at",
]

#: notes kept (the oldest overwritten past it): several times the most positions a
#: request can move back by (a backlog of 8 Steps)
_KEEP = 32
#: a note's four values in ``seen``: its position (0: no note), last token, hash count
#: and the index of the item holding its last hash
_WIDTH = 4
_SPAN = _KEEP * _WIDTH
#: the index of the first of the ring's last hashes (``t.last_at`` starts there)
FIRST_LAST = _SPAN


def new_seen() -> list[Any]:
    """An empty ring of notes (``t.seen``), one flat list: :data:`_KEEP` notes of
    :data:`_WIDTH` values, the newest at index ``t.seen_at``, then their last hashes
    (objects, compared by identity first), a ring of :data:`_KEEP` from
    :data:`FIRST_LAST`, the newest at ``t.last_at``, advanced only when the last hash
    changes (once a block, not once a token). A decode step's note overwrites a slot in
    place: no tuple, entry or table made, moved or freed per token (a dict of tuples
    cost twice the memory lines, and more instructions than these stores of a list's
    items)."""
    return [0] * _SPAN + [None] * _KEEP


def note(t: Any, tokens: Sequence[int], given: Sequence[bytes] | None) -> None:
    """Remember what the request's tracker ``t`` has sent at its position now: the last
    token (read from ``tokens``), the hash count and the last hash (from ``given``, the
    request's own hashes, ``None`` when the tracker hashes). A note equal to the newest
    is not written again (a request synced unchanged, as a waiting one looked up every
    step, keeps its older notes)."""
    n = t.sent_tokens
    if n:
        h = t.sent_hashes
        token, last = tokens[n - 1], given[h - 1] if h and given is not None else None
        ring, at = t.seen, t.seen_at
        if ring[at] == n and ring[at + 1] == token and ring[at + 2] == h and ring[ring[at + 3]] is last:
            return
        note_token(t, token, last)


def note_token(t: Any, token: int, last_hash: object) -> None:
    """:func:`note` with the last token and hash at hand (a decode step's, always at a
    new position), written over the oldest note (constant time): a position is only
    ever restored to the committed one or later, at most a client's backlog of Steps
    back (8), each noting one position per request."""
    ring = t.seen
    k = t.last_at
    if ring[k] is not last_hash:
        k += 1
        if k == _SPAN + _KEEP:
            k = _SPAN
        t.last_at = k
        ring[k] = last_hash
    at = t.seen_at + _WIDTH
    if at == _SPAN:
        at = 0
    t.seen_at = at
    ring[at] = t.sent_tokens
    ring[at + 1] = token
    ring[at + 2] = t.sent_hashes
    ring[at + 3] = k


def seen_at(t: Any, n: int) -> tuple[Any, int, object] | None:
    """The newest note at position ``n``: its last token, hash count and last hash
    (``None``: none kept)."""
    ring = t.seen
    at = t.seen_at
    for i in range(_KEEP):
        j = (at - i * _WIDTH) % _SPAN
        if ring[j] == n:
            return ring[j + 1], ring[j + 2], ring[ring[j + 3]]
    return None


def keep_note(t: Any) -> None:
    """The note of the position ``t`` was just restored to (:meth:`.tracking._Tracked.restore`)
    written again as the newest, unless it is: Steps failing one after the other, none
    answered, each note positions past it and are rolled back to it, and a ring written
    round since the position's own note loses it (its last hash too), so that a cut at
    that position read as "nothing noted: unchanged" and was synced as if nothing had
    happened. Kept newest at each restore, it stays within the notes of one backlog."""
    n = t.sent_tokens
    ring = t.seen
    if not n or ring[t.seen_at] == n:
        return
    seen = seen_at(t, n)
    if seen is not None and seen[1] == t.sent_hashes:
        note_token(t, seen[0], seen[2])


def forget_after(t: Any, n: int) -> None:
    """Drop the notes of positions past ``n`` (a rewind to ``n``)."""
    ring = t.seen
    for j in range(0, _SPAN, _WIDTH):
        if ring[j] > n:
            ring[j] = 0


def changed(t: Any, tokens: Sequence[int], given: Sequence[bytes] | None) -> bool:
    """Whether the request (its ``tokens`` and own hashes ``given``) no longer holds what
    its tracker ``t`` sent: fewer tokens, another last token, fewer hashes or another
    last hash than were sent. Constant time: only the last ones are compared. A tracker
    whose position moved back after a rewind it sent (the call failed) does not know
    what the server holds: always changed."""
    n = t.sent_tokens
    if not n:
        return False
    if t.uncertain:
        return True
    if len(tokens) < n:
        return True
    seen = seen_at(t, n)
    if seen is None:
        return False  # (nothing noted there: not a position this tracker sent)
    token, h, last = seen
    if tokens[n - 1] != token:
        return True
    if h and given is not None:
        if len(given) < h:
            return True
        now = given[h - 1]
        return now is not last and now != last
    return False


def rewind_point(request_id: str, t: Any, tokens: Sequence[int], given: Sequence[bytes] | None,
                 computed: int, hash_block_size: int) -> int:  # fmt: skip
    """Where a request that :func:`changed` is rewound to: its computed-token count
    ``computed`` (nothing below it can change; what lies past it is sent again).

    Raises:
        InvalidArgumentError: the change reaches a computed position (the last token
            sent changed, or tokens were dropped, at or below ``computed``; or the last
            hash sent changed in a block the kept hashes hold), or the request has no
            computed token (not a cut session: another request under a tracked id).
    """
    n, have = t.sent_tokens, len(tokens)
    seen = seen_at(t, n)
    hash_only = have >= n and seen is not None and tokens[n - 1] == seen[0] and not t.uncertain
    # the change is at or below ``bound``: refused when that reaches a computed position
    if hash_only and seen is not None:  # hash h - 1, the last sent, changed: at its block's last position
        bound = min(n, seen[1] * hash_block_size - 1)
    elif t.uncertain:  # what the server holds past the computed tokens is sent again
        bound = min(have, n)
    else:  # tokens were dropped, or the last token sent changed
        bound = have if have < n else n - 1
    if computed <= 0 or computed > bound:
        what = "its last hash sent changed" if hash_only else f"changed at or below position {bound}"
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request {request_id!r} changed below what the pool may drop: {n} tokens were sent "
            f"and it has {have} now, {what}, with {computed} computed tokens (a rewind keeps every computed token: their KV is written). "
            "Not a vLLM streaming-input cut; if another request uses this id, free the first one",
        )
    return computed
