"""Idempotency keys: a retried call is answered from memory, never applied twice.

A key belongs to one session and one RPC and is bound to the request's content (a
digest of its bytes). Answers are kept for ``window`` seconds after they were made.

One byte budget (``idempotency_max_bytes``) bounds everything kept: each entry counts
:data:`ENTRY_BYTES` plus its key and session id, and its answer while it holds one.
Past the budget the oldest answers go first; an answer pushed out early leaves a
tombstone (the entry without its answer, kept for the window like every key), so a
retry of it is refused with ANSWER_EVICTED instead of being applied a second time.
An answer larger than max_message_bytes (gRPC could never send it) is kept as a
tombstone from the start, for the same reason (mutations.py).
When tombstones alone fill the budget, the keys older than half the window go first:
no client retries that late (the client library retries a keyed call for at most
half the server's window). Only when the keys of the last half window alone fill the
budget is a call with a new key refused before it is applied (RESOURCE_EXHAUSTED,
nothing changed). A session's keys go when the session ends.

A key forgotten (its window passed, or pushed out to fit the budget) must not let a
copy of its call delivered late be applied as a new call: not every operation carries
a position that would refuse it (a FreeOp names only a request id, which vLLM reuses
for a request preempted and admitted again: applied late, it would free that
request's live blocks; an AllocateOp registering a new request would register a
finished one again and cache blocks whose KV nobody writes). So a keyed call may
carry its sequence number among its session's keyed calls (``call_sequence``,
strictly increasing in the order its client builds them; calls built by concurrent
threads may arrive in another order, which no number refuses until a key numbered at or
above it is forgotten, half a window or more after that key's call): the store keeps, per
session, the highest sequence number of a key it forgot, and a call at or below it
whose key it does not know is refused, ABORTED (ANSWER_EVICTED), never applied. A
call without a number (0: a client that sends none) is looked up as before. The
numbers of a session go with its keys when it ends; they are exported and restored
beside the entries (snapshots, handovers: :meth:`IdempotencyStore.export_sequences`),
and replaying the journal forgets keys as the live server did (by record time), so a
restart does not reopen the hole.

A call its client gave up on (OutcomeUnknownError) may never have reached the server
and still arrive later (held back on the way), numbered above every key forgotten: the
floor cannot refuse it, and its client meanwhile took its requests as lost (freed them,
admitted them again). So the client names such calls in its session's next keyed calls
(``abandoned``: key and number), and the server, before applying that call, keeps a
tombstone for each key it does not hold (:meth:`IdempotencyStore.abandon`; a key it holds
keeps its answer): the late delivery is refused, ABORTED (ANSWER_EVICTED), never applied,
and once the window passes, the tombstone's number joins the floor like any forgotten
key's. The tombstones are made inside the naming call's journal record (its request
carries them), so replay makes them again; snapshots and handovers carry them as entries
(rpc :data:`ABANDONED`, no answer) with their numbers.

A keyed call answered with its own error (an Allocate the engine refused, e.g.
HIT_BLOCK_TAKEN or UNCOUNTED_BLOCKS) keeps that refusal under its key, as an answer:
a retry, or a copy of the call delivered late, is told the same refusal and never
applied (applied after the pool changed, it could allocate a request its client was
told was refused). A refusal counts its message against the budget and is evicted as
an answer is; a snapshot or a handed-over pool keeps it as a tombstone (ANSWER_EVICTED
on a retry: still never applied), and replaying its journal record keeps it again.

Ages are kept on the server's lease clock while serving (the monotonic clock less the
time the server could not run: lease_clock.py; a retry that waited in its socket through
a pause finds its answer as a renewal finds its session). Across a restart, recovery
(recovery.py) restores them by serving time: an answer's age is measured up to the
last journaled record, so the downtime, and a wall clock set forward or back while
the server was down, neither expire an answer early nor apply a retry twice (answers
are kept longer by the downtime, never shorter). The replayed records' own times are
wall-clock differences within the history that wrote them; a negative one counts 0.

Plain Python, no gRPC messages: answers are opaque bytes, digests are bytes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Container
from typing import Any

from .errors import ErrorReason, ServiceError, Status

__all__ = ["ABANDONED", "ENTRY_BYTES", "IdempotencyStore", "KeptRefusal", "Stored", "entry_bytes"]

#: What an entry costs besides its key, session id and answer: the entry object, its
#: digest, the dict, deque and per-session set slots, its own copy of the session id
#: string (tracemalloc: about 460 bytes with a 32-character key and session id)
ENTRY_BYTES = 512

#: the rpc of a tombstone made because its client gave up on the call (no rpc or
#: digest known: any call with its key is refused, ANSWER_EVICTED)
ABANDONED = ""


def entry_bytes(session_id: str, key: str) -> int:
    """What an entry counts against the budget, its answer aside."""
    return ENTRY_BYTES + len(session_id) + len(key)


class KeptRefusal(ServiceError):
    """The refusal a keyed call was answered with, told again to a retry of its key."""


@dataclasses.dataclass(slots=True)
class Stored:
    rpc: str
    digest: bytes
    made_at: float
    answer: bytes | None  # None: evicted by the byte budget (a tombstone), or a refusal
    #: the call's own error, told again to a retry (None: an answer, or evicted)
    refusal: ServiceError | None = None
    #: the call's number among its session's keyed calls (0: none sent)
    sequence: int = 0

    def holds(self) -> bool:
        """Whether an answer or a refusal is kept (not a tombstone)."""
        return self.answer is not None or self.refusal is not None

    def kept_bytes(self) -> int:
        """What the answer (or refusal) kept counts against the budget, besides the entry."""
        if self.answer is not None:
            return len(self.answer)
        return len(self.refusal.message.encode()) if self.refusal is not None else 0


class IdempotencyStore:
    """Answers of keyed calls, by (session, key).

    Args:
        clock: monotonic seconds (injected, so tests need no sleeping).
        window: seconds an answer is kept; clients retry only inside it.
        max_bytes: the budget for everything kept (entries and answers); the oldest
            answers go first.
    """

    def __init__(self, clock: Callable[[], float], window: float, max_bytes: int) -> None:
        self.clock = clock
        self.window = window
        self.max_bytes = max_bytes
        #: bytes counted: every entry (:func:`entry_bytes`) and every answer kept
        self.bytes = 0
        #: the entries' share of :attr:`bytes` (what evicting answers cannot free)
        self.entry_bytes = 0
        self._entries: collections.OrderedDict[tuple[str, str], Stored] = collections.OrderedDict()
        #: entries that may still hold an answer, oldest first (the budget evicts from
        #: the left; entries whose answer is gone are skipped), so eviction is O(1) each
        self._answered: collections.deque[Stored] = collections.deque()
        self._by_session: dict[str, set[str]] = {}
        #: per session, the highest call sequence number of a key forgotten (its
        #: window passed, or dropped to fit the budget): a call at or below it whose
        #: key is not kept is a late copy, never applied
        self._forgotten: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, session_id: str, rpc: str, key: str, digest: bytes, sequence: int = 0) -> bytes | None:
        """The kept answer of an earlier call with this key, or ``None`` if it is new.
        ``sequence``: the call's number among its session's keyed calls (0: none).

        Raises:
            ServiceError: INVALID_ARGUMENT (KEY_REUSED) when the key was used for
                another RPC or another body; ABORTED (ANSWER_EVICTED) when the call
                was applied but its answer is no longer kept, or when its key is not
                kept and ``sequence`` is at or below the highest one forgotten of its
                session (a copy delivered late); :class:`KeptRefusal`, the
                error the call was answered with (:meth:`remember`'s ``refusal``); RESOURCE_EXHAUSTED for a
                new key when the budget is full of entries (their answers already
                evicted): the call must not be applied, it could not be kept.
        """
        if not key:
            return None
        self.expire()
        entry = self._entries.get((session_id, key))
        if entry is None:
            floor = self._forgotten.get(session_id, 0)
            if sequence and sequence <= floor:
                raise ServiceError(
                    Status.ABORTED,
                    f"the call with idempotency key {key[:64]!r} (call_sequence {sequence}) is older than "
                    f"the calls of this session whose keys are forgotten (up to {floor}): a copy delivered "
                    "after its key's window, or a call sent that long ago; it is not applied now. If it was "
                    "applied earlier, its answer is not kept: treat the requests it named as lost",
                    ErrorReason.ANSWER_EVICTED,
                )
            self._make_room(session_id, key)
            return None
        if entry.rpc == ABANDONED:
            raise ServiceError(
                Status.ABORTED,
                f"the call with idempotency key {key[:64]!r} (call_sequence {sequence}) was given up on by its "
                "client (a later call of this session named it abandoned) before it reached the server: it is "
                "not applied now; its client took the requests it named as lost",
                ErrorReason.ANSWER_EVICTED,
            )
        if entry.rpc != rpc or entry.digest != digest:
            what = f"a {entry.rpc} call" if entry.rpc != rpc else "another request body"
            raise ServiceError(
                Status.INVALID,
                f"idempotency key {key[:64]!r} was already used by this session for {what}; "
                "use a new key for a new call",
                ErrorReason.KEY_REUSED,
            )
        if entry.refusal is not None:  # told again as it was (a copy: raised anew)
            r = entry.refusal
            raise KeptRefusal(r.status, r.message, r.reason, r.position)
        if entry.answer is None:
            raise ServiceError(
                Status.ABORTED,
                f"the call with idempotency key {key[:64]!r} was applied, but its answer is not kept "
                f"(dropped to stay within idempotency_max_bytes ({self.max_bytes}), or larger than "
                "max_message_bytes: never sendable); treat the requests it named as lost",
                ErrorReason.ANSWER_EVICTED,
            )
        return entry.answer

    def abandon(
        self, session_id: str, own_key: str, calls: list[tuple[str, int]], replaying: bool = False
    ) -> None:
        """Keep a tombstone for each (key, call sequence number) of ``calls``, the calls
        of this session its client gave up on, that is neither kept already (a held
        answer stays: a retry of it is answered) nor covered by the session's floor; the
        call naming them has the key ``own_key``. A key's later delivery is then refused
        (:meth:`lookup`: ANSWER_EVICTED), and once the window passes its number joins
        the floor. ``replaying``: the naming call was applied (journal replay), so its
        tombstones are kept whatever the budget is now, as :meth:`remember` keeps a
        replayed call's key (a restart with a smaller idempotency_max_bytes must replay).

        Raises:
            ServiceError: INVALID_ARGUMENT when a key is empty or the naming call's own;
                RESOURCE_EXHAUSTED as :meth:`lookup` for a new key, unless ``replaying``
                (some tombstones may be kept already: they only refuse calls their
                client gave up on).
        """
        if not calls:
            return
        for key, _ in calls:  # (all checked before any is kept)
            if not key or key == own_key:
                raise ServiceError(
                    Status.INVALID,
                    "abandoned names "
                    + ("an empty idempotency key" if not key else "the call's own idempotency key"),
                )
        self.expire()
        now = self.clock()
        for key, sequence in calls:
            if (session_id, key) in self._entries or (
                sequence and sequence <= self._forgotten.get(session_id, 0)
            ):
                continue
            if not replaying:
                self._make_room(session_id, key)
            entry = Stored(ABANDONED, b"", now, None, None, sequence)
            self._entries[(session_id, key)] = entry
            self._by_session.setdefault(session_id, set()).add(key)
            cost = entry_bytes(session_id, key)
            self.entry_bytes += cost
            self.bytes += cost
            self._evict_to_budget()

    def _make_room(self, session_id: str, key: str) -> None:
        """Make room for a new key's entry (dropping keys past every client's retries).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED when the keys of the last half window alone
                fill the budget: the call must not be applied, it could not be kept.
        """
        need = entry_bytes(session_id, key)
        if self.entry_bytes + need > self.max_bytes:
            self._drop_past_retries(self.max_bytes - need)
        if self.entry_bytes + need > self.max_bytes:
            raise ServiceError(
                Status.EXHAUSTED,
                f"idempotency_max_bytes ({self.max_bytes:,}) is taken by the {len(self._entries):,} keys "
                f"of the last {self.window / 2:g} s ({self.entry_bytes:,} bytes, answers already "
                "dropped); nothing was applied: retry later, or raise server.idempotency_max_bytes",
            )

    def as_of(self, age: float, change: Callable[[], object]) -> None:
        """Forget the keys older than the window and make ``change`` as ``age`` seconds
        ago (journal replay: a record's time, so keys are forgotten, their numbers
        counted, as they were live)."""
        real = self.clock
        at = real() - age  # the record's time on the monotonic clock
        self.clock = lambda: at
        try:
            self.expire()
            change()
        finally:
            self.clock = real

    def remember(
        self, session_id: str, rpc: str, key: str, digest: bytes, answer: bytes | None,
        refusal: ServiceError | None = None, sequence: int = 0,
    ) -> None:  # fmt: skip
        """Keep ``answer`` for retries of this key (a no-op without a key). ``None``
        keeps a tombstone at once: the call was applied but its answer cannot be sent
        (larger than max_message_bytes), so a retry is refused with ANSWER_EVICTED,
        never applied again. ``refusal`` (with ``answer`` None): the call was answered
        with this error, which a retry is told again. ``sequence``: the call's number
        among its session's keyed calls (0: none), counted when the key is forgotten."""
        if not key:
            return
        now = self.clock()
        old = self._entries.pop((session_id, key), None)
        if old is not None:
            self._forget(session_id, key, old)
        entry = Stored(rpc, digest, now, answer, refusal if answer is None else None, sequence)
        self._entries[(session_id, key)] = entry
        if entry.holds():
            self._answered.append(entry)
        self._by_session.setdefault(session_id, set()).add(key)
        cost = entry_bytes(session_id, key)
        self.entry_bytes += cost
        self.bytes += cost + entry.kept_bytes()
        self._evict_to_budget()

    def drop_session(self, session_id: str) -> None:
        """Forget every key of a session (it ended: nobody can retry its calls, and a
        late copy of one is refused for its session, which is gone)."""
        self._forgotten.pop(session_id, None)
        for key in self._by_session.pop(session_id, ()):
            entry = self._entries.pop((session_id, key), None)
            if entry is not None:
                self._forget(session_id, key, entry)

    def expire(self) -> None:
        """Drop entries older than the window (oldest first, so this stops early)."""
        self._drop_older_than(self.clock() - self.window)

    def _drop_past_retries(self, fit: int) -> None:
        """Drop keys older than half the window (no client retries them) until the
        entries count at most ``fit`` bytes."""
        self._drop_older_than(self.clock() - self.window / 2, fit)

    def _drop_older_than(self, horizon: float, fit: int | None = None) -> None:
        """Drop entries made before ``horizon``, oldest first (with ``fit``: only while
        the entries count more than ``fit`` bytes)."""
        entries = self._entries
        while entries:
            (sid, key), entry = next(iter(entries.items()))
            if entry.made_at > horizon or (fit is not None and self.entry_bytes <= fit):
                break
            del entries[(sid, key)]
            if entry.sequence > self._forgotten.get(sid, 0):
                self._forgotten[sid] = entry.sequence
            self._forget(sid, key, entry)
            keys = self._by_session.get(sid)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_session[sid]

    def export(self) -> list[tuple[str, str, str, bytes, float, bytes | None]]:
        """Every entry kept across a restart as (session, key, rpc, digest, age in
        seconds, answer), oldest first: not the unjournaled ones (:func:`score_key_owner`),
        which a restart forgets, from a snapshot too. A refusal goes as a tombstone
        (answer None). Their call sequence numbers: :meth:`export_sequences`."""
        now = self.clock()
        return [
            (sid, key, e.rpc, e.digest, now - e.made_at, e.answer)
            for (sid, key), e in self._entries.items()
            if not sid.startswith(_UNJOURNALED)
        ]

    def export_sequences(self, sessions: Container[str] | None = None) -> dict[str, Any]:
        """The call sequence numbers kept across a restart beside :meth:`export`'s
        entries (of ``sessions`` only, when given): ``forgotten``, per session, the
        highest one of a key forgotten; ``calls``, [session, key, number] of each
        entry that has one. (Apart from the entries, so that a snapshot stays
        readable by a kvcoord that predates them.)"""
        return {
            "forgotten": {
                sid: n for sid, n in self._forgotten.items() if sessions is None or sid in sessions
            },
            "calls": [
                [sid, key, e.sequence]
                for (sid, key), e in self._entries.items()
                if e.sequence and (sessions is None or sid in sessions)
            ],
        }

    def restore_sequences(self, value: dict[str, Any] | None) -> None:
        """Load what :meth:`export_sequences` made, after the entries (None: a
        snapshot written before sequence numbers, which has none)."""
        if not value:
            return
        for sid, n in value.get("forgotten", {}).items():
            if n > self._forgotten.get(sid, 0):
                self._forgotten[sid] = int(n)
        for sid, key, n in value.get("calls", ()):
            entry = self._entries.get((sid, key))
            if entry is not None:
                entry.sequence = int(n)

    def restore(self, entries: list[tuple[str, str, str, bytes, float, bytes | None]]) -> None:
        """Load entries made by :meth:`export` (ages count back from now)."""
        now = self.clock()
        for sid, key, rpc, digest, age, answer in entries:
            entry = Stored(rpc, digest, now - age, answer)
            self._entries[(sid, key)] = entry
            self._answered.append(entry)
            self._by_session.setdefault(sid, set()).add(key)
            cost = entry_bytes(sid, key)
            self.entry_bytes += cost
            self.bytes += cost + (len(answer) if answer is not None else 0)

    def _forget(self, session_id: str, key: str, entry: Stored) -> None:
        """Take a removed entry (and its answer) off the count."""
        cost = entry_bytes(session_id, key)
        self.entry_bytes -= cost
        self.bytes -= cost + entry.kept_bytes()
        entry.answer = entry.refusal = None

    def _evict_to_budget(self) -> None:
        """Turn the oldest answers into tombstones until the budget holds again."""
        answered = self._answered
        while answered and (self.bytes > self.max_bytes or not answered[0].holds()):
            entry = answered.popleft()
            self.bytes -= entry.kept_bytes()
            entry.answer = entry.refusal = None


_UNJOURNALED = "score-pools:"


def score_key_owner(tenant: str) -> str:
    """Whose a reserving ScorePools' idempotency key is: the caller's tenant (the call
    has no session). No session id has this form (they are hex digits), so the two never
    share keys. These answers are not journaled and not exported into snapshots: the
    reservations they name are released by a restart, so a retry after one reserves
    anew."""
    return _UNJOURNALED + tenant
