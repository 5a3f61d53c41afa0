"""Journal positions in fences: clients prove what they were told.

Every answer's fence carries the journal position it is durable at
(``Fence.position``: the last committed record when it left). A client keeps the
highest position of the fence it holds and sends it back with every fenced call,
renewals included. A restarted server knows, for each earlier instance whose journal
it recovered, the last record of that instance it holds (:attr:`JournalPositions.ends`:
up to the next instance's ``start`` record, or the journal's end). A fence naming such
an instance with a higher position, and that position's tag (below), proves the journal
is behind what that client was told: the data directory was restored from an older copy (a volume snapshot, ``cp -a``,
a backup) whose ``journal.progress`` came with it, so start-up could not see it. The
server then does what a restore detected at start does (recovery.py): every session
ends, every earlier fence is void, every prefix cache is emptied, and no session may
attach for ``max_session_lease_seconds`` (persisted in grace.json); the call that
proved it fails INSTANCE_CHANGED.

Positions name records of one instance, so records a restored server writes after its
start can never pass for the lost ones. What remains is the time before the first such
call (deploy/README.md, "Restore the volume").

**An instance the journal never heard of.** A lost history that spans a restart (the
copy made, then the server restarted: a pod rescheduled, an OOM kill) ends with
instances whose ``start`` record the copy lacks, and its workers' fences name the last
of them. A fence of an instance this journal does not know is void anyway
(INSTANCE_CHANGED), but when its tag verifies under this journal's key only a copy of
this very journal can have issued it: it proves the restore as well
(:meth:`JournalPositions.check_unknown`). Not every unknown instance proves one: the
instances a restore already voided (:attr:`JournalPositions.settled`: those the journal
named then, and the one whose fence proved it; journaled with the ``restored`` record,
carried by snapshots) are only INSTANCE_CHANGED from then on, so the other workers of
the same lost history start no second fencing.

**Generations.** The lost history may hold more instances the copy never heard of
than the one that proved it (two restarts after the copy): their workers may call
long after the fencing and its grace (a paused VM, a partition), and nothing names
them. So every proven restore begins a *generation* (its ``restored`` record names
it), and an instance tags under the key of the generation it started in (derived
from the journal's key; generation 0 is the key itself). An unknown instance proves
a restore only when its tag verifies under this journal's generation or a later one
(up to :data:`GENERATIONS_AHEAD`: a copy older than restores proven since): a lost
instance of a restore proven already started in an earlier generation and is only
INSTANCE_CHANGED, while one of a new restore started from a copy that holds every
``restored`` record it has. An instance serving when a restore is proven keeps its
generation (its own positions are checked as ever). A snapshot of a kvcoord before
863d21c taken at an instance's own ``start`` record names no generation for it, as
if it had served when the restore was proven; its first tagged answer replayed tells
which (:meth:`JournalPositions.snapshot_loaded`).

**Only positions this journal issued prove anything.** A position is a number any
caller can write: taken on trust, one made-up ``Fence.position`` of an earlier instance
(any tenant's, with no session even) ended every session of every tenant and froze
Attach for the grace period. So every position the server issues goes out with its
tag (``Fence.position_tag``, :meth:`JournalPositions.tag`): an HMAC-SHA256 of the
instance id and the position under the journal's fence key, a random secret kept in the
journal file itself (journal.py, ``meta``), made when the journal is created. A restored
copy of the journal holds the same key, so a tag of the lost history still verifies
there; a key of another journal does not. A position above what the journal holds
whose tag does not verify is refused (INVALID_ARGUMENT, FENCE_UNPROVEN) and changes
nothing; positions the journal holds need no tag (they prove nothing: clients of a
kvcoord without tags send them untagged). The incarnation is not in the tag: a
position is a record of the journal, whichever pool's answer told it; so a fence's
position is checked before its incarnation (PoolService.check_fence), and before
NOT_FOUND for a pool the server does not have (PoolRegistry.get): a worker of a pool
deleted and created again after the copy was made, or created after it, holds
positions the copy lacks, and refused INCARNATION_CHANGED or NOT_FOUND first its call
proved nothing (the next worker to attach was handed the blocks it still held).

A Step's, Allocate's or Free's position is checked before its session
(PoolService.session), and so is a Heartbeat's or a Detach's when the session is not
held here (:meth:`JournalPositions.prove`): a worker that attached after the copy was
made has no session in it, and its call must prove the restore (a session check first
would answer SESSION_EXPIRED, the worker would attach again at once and could be
handed blocks a worker of the lost history still holds, or a hit on cache entries
whose blocks the lost history wrote other KV into; an idle worker's only calls are
its renewals). With the tag, a caller without a session can prove only what is true.

A tag is part of its answer (its digest in the journal, its bytes kept for a retry),
so replay tags with the writer's key: this journal's own, or, for a pool rebuilt from
the cluster store (``journal = "store"``), the key its stream's base record carries
(store_journal.py). Records written before tags replay untagged, as they were told
(mutations.py). Positions of another replica's instances are never checked (no
journal here holds their records: :attr:`ends` names none). A pool rebuilt from the
cluster store, here or by another replica that hands it over here later, may bring
records of an earlier instance of this very journal that its own copy lacks (killed
between the two commits): their positions are held from then on
(:meth:`JournalPositions.brought`, journaled with the pool's ``adopt`` record).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Container, Iterable
from typing import Any, NoReturn

from .errors import ErrorReason, ServiceError, Status
from .fences import Fence

__all__ = ["TAG_BYTES", "JournalPositions"]

#: bytes of a position's tag (HMAC-SHA256 cut to 128 bits)
TAG_BYTES = 16
#: generations past this journal's own an unknown instance's tag is tried under (a copy
#: older than restores proven later: positions.py, "Generations")
GENERATIONS_AHEAD = 8


class JournalPositions:
    """The last record of each earlier instance this journal holds, and the check."""

    def __init__(self) -> None:
        #: instance id -> its last record in this journal
        self.ends: dict[str, int] = {}
        #: the instance whose ``start`` record came last (its end is not known yet)
        self.latest: str | None = None
        #: called once the journal is found behind a client (server.py fences everything)
        self.on_behind: Callable[[str], None] | None = None
        #: the journal's fence key (journal.py; None: no journal, or a pool rebuilt from
        #: a cluster store stream written before tags)
        self.key: bytes | None = None
        #: instances a restore voided (their fences prove nothing any more, see
        #: :meth:`check_unknown`)
        self.settled: set[str] = set()
        #: restores proven in this journal's history (``restored`` records that name it)
        self.generation = 0
        #: instance id -> the generation it started in (absent: 0): it tags under that
        #: generation's key (:meth:`key_of`)
        self.generations: dict[str, int] = {}
        #: (instance, generation): a loaded snapshot does not say whether the instance
        #: writing the records after it started in generation 0 or in this one
        #: (:meth:`snapshot_loaded`); its first tagged answer replayed decides
        self.undecided: tuple[str, int] | None = None

    def key_of(self, instance_id: str) -> bytes | None:
        """The key ``instance_id`` tags its positions under (a cluster store's stream
        carries its writer's: store_rebuild.py)."""
        return self._key(self.generations.get(instance_id, 0))

    def _key(self, generation: int) -> bytes | None:
        if self.key is None or not generation:
            return self.key
        return hmac.digest(
            self.key, b"kvcoord restore generation\0" + generation.to_bytes(8, "big"), "sha256"
        )

    def tag(self, instance_id: str, position: int, generation: int | None = None) -> bytes:
        """What proves that this journal told ``position`` of ``instance_id`` (b"":
        no key, or no position), under the key of the generation it started in (or
        ``generation``'s)."""
        key = self.key_of(instance_id) if generation is None else self._key(generation)
        if key is None or not position:
            return b""
        message = instance_id.encode() + b"\0" + position.to_bytes(8, "big")
        return hmac.digest(key, message, "sha256")[:TAG_BYTES]

    def started(self, instance_id: str, seq: int) -> None:
        """Instance ``instance_id`` wrote its ``start`` record at ``seq`` (in the
        current generation)."""
        if self.latest is not None:
            self.ends[self.latest] = seq - 1
        self.latest = instance_id
        if self.generation:
            self.generations[instance_id] = self.generation

    def snapshot_loaded(self, writer: str) -> None:
        """Recovery loaded a snapshot followed by records of ``writer``. A kvcoord
        before 863d21c took the snapshot its own ``start`` record triggered before it
        set its generation: taken after a proven restore, it names no generation for
        the writer, whose answers were tagged under the restore's. A writer that
        started before the restore, serving when it was proven, looks the same (and
        tagged under generation 0's key): until one of its answers decides
        (:meth:`replay_tags`), both are possible."""
        if self.generation and writer and self.latest == writer and writer not in self.generations:
            self.undecided = (writer, self.generation)

    def replay_tags(self, instance_id: str, position: int) -> list[bytes]:
        """The tags a replayed answer of ``instance_id`` at ``position`` may have been
        told with, in the order tried: under its generation's key; under the other one
        of :attr:`undecided`; none (a kvcoord that did not tag positions). Each is an
        HMAC under a key of this journal: only the one its client was told gives the
        answer's journaled digest (mutations.py), so no other answer passes for it."""
        tags = [self.tag(instance_id, position)]
        if self.undecided is not None and self.undecided[0] == instance_id:
            tags.append(self.tag(instance_id, position, self.undecided[1]))
        return [*tags, b""] if tags[0] else tags

    def told_with(self, instance_id: str, position: int, tag: bytes) -> None:
        """A replayed answer of ``instance_id`` at ``position`` was told with ``tag``
        (one of :meth:`replay_tags`): a tag decides :attr:`undecided`, and from then on
        the instance tags under the generation it was told with."""
        if not tag or self.undecided is None or self.undecided[0] != instance_id:
            return
        generation = self.undecided[1]
        self.undecided = None
        if tag == self.tag(instance_id, position, generation):
            self.generations[instance_id] = generation

    def next_generation(self, at_least: int = 0) -> int:
        """A restore is proven: instances started from now on tag under a new key
        (the ``restored`` record names the generation it begins; an instance serving
        now keeps its own). ``at_least``: the generation grace.json names, when this
        journal is short of it by more than one (put back from an older copy beside a
        newer grace.json): one fencing ends everything, so it begins that generation at
        once (startup.py, ``unfenced_restore``; was one fencing, and a new full grace,
        per restart until the journal got there)."""
        self.generation = max(self.generation + 1, at_least)
        return self.generation

    def ended(self, last_seq: int) -> None:
        """Recovery replayed the journal up to ``last_seq``: the latest instance ended there."""
        if self.latest is not None:
            self.ends[self.latest] = last_seq
            self.latest = None

    def held(self, ends: dict[str, int]) -> None:
        """This journal holds records of earlier instances up to ``ends`` (a pool loaded
        here brought them, :meth:`brought`; an ``adopt`` record's, on replay): an end
        only goes up, and only for an instance this journal already names (never one
        of another journal, nor one a restore voided)."""
        for instance_id, position in ends.items():
            end = self.ends.get(instance_id)
            if end is not None and int(position) > end:
                self.ends[instance_id] = int(position)

    def brought(self, held: dict[str, list[Any]]) -> dict[str, int]:
        """A pool was loaded here whose state holds records of earlier instances up to
        ``held`` (instance id -> [position, that position's tag]: ``PoolService.held``),
        rebuilt from its stream in the cluster store (``journal = "store"``) or handed
        over by another replica; returns the ends raised (:meth:`held`; the caller
        journals them with the pool's ``adopt`` record).

        Each record goes to the local journal and to the store at once, and its answer
        waits for both: an instance killed in between leaves the store ahead of this
        journal by records no client was told. Whoever rebuilds the pool then holds
        them (store_rebuild.py), and a retry of their call is answered from them, with
        their positions: a client is told of a record of an instance of this very
        journal that its own copy lacks, though nothing is lost (the pool holds it, and
        carries it with every handover, the one back here included). Without this, that
        client's next call here "proved" a restored data directory.

        Only what this journal issued counts: an instance it names, and a tag it made
        for that position (its key: a tag is what a client would show, and a state
        handed over cannot make one up). A restore still shows: a fence above what the
        pools loaded here hold proves it as before."""
        raised: dict[str, int] = {}
        for instance_id, (position, tag) in held.items():
            end = self.ends.get(instance_id)
            if end is None or int(position) <= end:
                continue
            issued = self.tag(instance_id, int(position))
            if issued and isinstance(tag, bytes) and hmac.compare_digest(tag, issued):
                raised[instance_id] = int(position)
        self.held(raised)
        return raised

    def voided(self, lineage: Iterable[str] = (), keep: str = "") -> list[str]:
        """Every fence of an instance but ``keep`` (the one serving) is void (a restore
        was detected): nothing left to check of them. The instances named until now (and
        ``lineage``, the registry's earlier instances) are :attr:`settled`: their fences
        never prove a restore again. Returns every settled instance (the ``restored``
        record names them: :meth:`void`, on replay)."""
        gone = {*self.ends, *lineage} | ({self.latest} if self.latest is not None else set())
        gone.discard(keep)
        self.void(gone)
        return sorted(self.settled)

    def void(self, instances: Iterable[str]) -> None:
        """``instances`` are void and :attr:`settled` (a ``restored`` record replayed:
        the instance that wrote it, if it is the latest, stays as it was)."""
        for instance_id in instances:
            self.settled.add(instance_id)
            self.ends.pop(instance_id, None)
            if self.latest == instance_id:
                self.latest = None

    def void_all(self) -> None:
        """A ``restored`` record of a kvcoord that did not name the instances it voided:
        every one named until then is void."""
        self.void([*self.ends, *([self.latest] if self.latest is not None else [])])

    def export(self) -> dict[str, object]:
        return {
            "ends": dict(self.ends),
            "latest": self.latest,
            "settled": sorted(self.settled),
            "generation": self.generation,
            "generations": dict(self.generations),
        }

    def restore(self, state: dict[str, object] | None) -> None:
        if state:
            self.ends.update(state.get("ends") or {})  # type: ignore[call-overload]
            latest = state.get("latest")
            self.latest = str(latest) if latest else None
            self.settled.update(str(i) for i in state.get("settled") or ())  # type: ignore[attr-defined]
            self.generation = int(state.get("generation") or 0)  # type: ignore[call-overload]
            self.generations.update(state.get("generations") or {})  # type: ignore[call-overload]

    def check(self, fence: Fence) -> None:
        """Raise when ``fence`` proves this journal is behind what its holder was told.

        Raises:
            ServiceError: FAILED_PRECONDITION, INSTANCE_CHANGED (after :attr:`on_behind`);
                INVALID_ARGUMENT, FENCE_UNPROVEN when its position is above the journal's
                but its tag is missing or not this journal's (nothing changed).
        """
        if not fence.position:
            return
        end = self.ends.get(fence.instance_id)
        if end is None or fence.position <= end:
            return
        issued = self.tag(fence.instance_id, fence.position)
        if not issued or not hmac.compare_digest(fence.position_tag, issued):
            raise ServiceError(
                Status.INVALID,
                f"the fence names record {fence.position} of instance {fence.instance_id[:40]!r} without "
                "a position_tag this journal issued with it: positions are sent back as the server's "
                "answers gave them (Fence.position with Fence.position_tag); nothing changed",
                ErrorReason.FENCE_UNPROVEN,
            )
        self._behind(
            fence.instance_id,
            f"a client was told of record {fence.position} of instance {fence.instance_id[:40]!r}, this "
            f"journal holds its records up to {end} only: the data directory was restored from an "
            "older copy",
        )

    def prove(self, fence: Fence, instance_id: str, lineage: Container[str]) -> None:
        """The position of a call whose session the server does not hold (a Heartbeat,
        a Detach to the server ``instance_id`` of ``lineage``), checked before it is told
        SESSION_EXPIRED, as a Step's is (PoolService.session): a worker that attached
        after the copy was made has no session in it, and one told SESSION_EXPIRED
        attaches again at once, the fence that proved the restore dropped.

        Raises:
            ServiceError: as :meth:`check` and :meth:`check_unknown`.
        """
        if fence.instance_id == instance_id or fence.instance_id in lineage:
            self.check(fence)
        else:
            self.check_unknown(fence)

    def check_unknown(self, fence: Fence) -> None:
        """``fence`` names an instance the server does not know (the caller refuses it
        INSTANCE_CHANGED after this): raise when its tag proves that a copy of this
        journal issued it, an instance whose ``start`` record this journal lacks
        (unless a restore voided it already: :attr:`settled`; or it started in a generation
        before this journal's: a restore proven already). A tag that does not
        verify proves nothing (another journal's instance: another replica, a journal
        started empty) and raises nothing here.

        Raises:
            ServiceError: FAILED_PRECONDITION, INSTANCE_CHANGED (after :attr:`on_behind`).
        """
        if not fence.position or fence.instance_id in self.settled:
            return
        if fence.instance_id in self.ends:
            self.check(fence)
            return
        ahead = range(self.generation, self.generation + GENERATIONS_AHEAD)
        if not any(self._verifies(fence, self.tag(fence.instance_id, fence.position, g)) for g in ahead):
            return  # (an earlier generation's: a lost instance of a restore proven already)
        self._behind(
            fence.instance_id,
            f"a client was told of record {fence.position} of instance {fence.instance_id[:40]!r}, an "
            "instance of this journal (its key tagged that position) whose records this journal does not "
            "hold at all: the data directory was restored from an older copy",
        )

    @staticmethod
    def _verifies(fence: Fence, issued: bytes) -> bool:
        return bool(issued) and hmac.compare_digest(fence.position_tag, issued)

    def _behind(self, instance_id: str, reason: str) -> NoReturn:
        """The journal is behind what ``instance_id`` told a client: tell
        :attr:`on_behind` (its instance settled first: the ``restored`` record names it),
        then refuse the call that proved it."""
        self.settled.add(instance_id)
        if self.on_behind is not None:
            self.on_behind(reason)
        raise ServiceError(
            Status.PRECONDITION,
            f"{reason}; every session is ended and every block id you hold is void: attach again (after "
            "the grace period) and recompute your requests",
            ErrorReason.INSTANCE_CHANGED,
        )
