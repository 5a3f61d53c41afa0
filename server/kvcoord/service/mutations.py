"""The one way a mutating call is run, live and on replay.

A keyed call (Allocate, Free, Step) goes through the same steps whatever it does: its
session is checked, its idempotency key looked up (a duplicate is answered with the
kept answer, or told the kept refusal, never applied again), the call applied, its answer stamped with the
journal position of its own record and that position's tag (positions.py), the answer
kept under its key, the call journaled with the answer's digest, and the answer sent
only once the record is durable: as the bytes serialized for its key and its record
(gRPC sends them as they are: rpc_guard.BYTES_ANSWERS), never serialized a second time.
An answer larger than max_message_bytes, which gRPC would refuse to send, is told as
ABORTED (ANSWER_EVICTED: applied, its requests lost) and its key kept as a tombstone.
Every other mutating call ends with the same commit wait (:meth:`durable`);
a reserving ScorePools keeps its answer under its tenant's key here too, unjournaled
(:meth:`MutationRunner.kept_unjournaled`).
Replay (recovery.py) applies a journaled call with the same :class:`Mutation`, so
the answer it rebuilds is the one the client was told, byte for byte, or the start
stops.

What a call does is its :class:`Mutation`: how its request is read and how it is
applied and answered (the servicer's translation). This module sees the messages
only as bytes, a pool, a session id, a key and a fence; it imports no gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from .durability import Recorder, answer_digest
from .errors import ErrorReason, ServiceError, Status
from .idempotency import KeptRefusal
from .mutation_bodies import (
    DIGEST_SLICE_BYTES,
    abandoned_calls,
    body_digest,
    joined,
    keyed_body_slices,
    repeated_slices,
    request_digest,
    small_body,
    take_events_budget,
)
from .pool_service import Fence, PoolService
from .registry import PoolRegistry
from .sessions import Session
from .turns import PoolTurns

__all__ = [
    "SLICE_OPS",
    "Mutation",
    "MutationRunner",
]


#: an answer message (its ``fence`` is stamped with journal positions)
A = TypeVar("A", bound=Message)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Mutation(Generic[A]):
    """One keyed mutating RPC.

    Args:
        rpc: its name (the idempotency store's and the journal's).
        parse: its request from bytes (the journal keeps the request's bytes).
        apply: ``apply(service, session, request, answer fence, max_message_bytes)``:
            the answer, or the error its client is told after the call changed the
            pool (journaled too: an Allocate refused with must_succeed has removed
            skipped blocks, as vLLM's does). An error raised instead changed nothing
            and is not journaled.
        slices: see below.
    """

    rpc: str
    parse: Callable[[bytes], Any]
    apply: Callable[[PoolService, Session, Any, Fence, int], A | ServiceError]
    #: ``apply`` in slices (None: applied at once): ``slices(service, session,
    #: request, answer fence, max_message_bytes, every)`` yields after every ``every``
    #: operations, returns what ``apply`` would; a live call runs it (replay: ``apply``)
    slices: (
        Callable[[PoolService, Session, Any, Fence, int, int], Generator[None, None, A | ServiceError]] | None
    ) = None


#: operations between two looks at the clock in a sliced call
SLICE_OPS = 16
#: operations of a large Step serialized (its key's digest, its record) or checked
#: (bounds.py) at once, between two turns of the event loop (1,024 held it 8-20 ms)
SERIALIZE_SLICE_OPS = 128


class MutationRunner(PoolTurns):
    """Runs keyed calls (and the commit wait of every mutating call) for a registry; a
    large one's rest in turns, its pool held (:class:`~.turns.PoolTurns`).

    Args:
        registry: the pools, sessions, idempotency store and recorder (read at each
            call: recovery replaces the recorder).
        max_message_bytes: the answer budget; a Step's events are cut below it (0: none).
    """

    def __init__(self, registry: PoolRegistry, max_message_bytes: int = 0) -> None:
        super().__init__(registry)
        self.max_message_bytes = max_message_bytes

    async def run(self, m: Mutation[A], request: Any, fence: Fence | None) -> bytes:
        """Apply ``request`` once (a duplicate gets the kept answer) and answer once
        durable, with the answer's serialized bytes (serialized once, for its key, its
        record and its client; its fence stamped with its record's journal position).

        A call whose Mutation has ``slices`` (a Step, an Allocate) that takes longer than
        ``slice_seconds`` goes on in a task of its own that holds the pool
        (pool_locks.py) and lets the event loop serve other pools between slices; the
        call waits for it (a call cancelled meanwhile, its client gone, still has it
        applied, journaled and its answer kept, once).

        Raises:
            ServiceError: the pool's, the session's or the key's refusal, or the call's
                own error (after it is journaled when it changed the pool).
        """
        registry = self.registry
        key = request.idempotency_key
        body = None
        digest = b""
        if key:  # serialized once: the key's digest and the journal's record (a Step may be 15 MB)
            body = small_body(request, SERIALIZE_SLICE_OPS)
            if body is not None and len(body) <= DIGEST_SLICE_BYTES:  # (most calls: no generator)
                digest = body_digest(body)
            else:
                serializing = keyed_body_slices(request, SERIALIZE_SLICE_OPS, body)
                while True:
                    try:
                        next(serializing)
                    except StopIteration as serialized:
                        body, digest = serialized.value
                        break
                    await asyncio.sleep(0)  # (the pool is not touched yet)
        # Held from here until the call is applied (or handed to the task applying it in
        # slices): a call that merely waited for the pool would run on while the pool was
        # already handed to the next waiter, and could not hold it for its own slices.
        # Nothing awaits while it is held, so no other task sees the hold.
        pool = request.pool
        # the answer (new, or kept: its record may still be on its way) waits for the
        # pool's records; a sliced task inherits this (was: a copy told the kept answer
        # though the store write it waited for was given up, the pool's next owner without it)
        registry.recorder.answers_on(pool)
        await registry.locks.acquire(pool)  # a Step applied to it in slices ends first
        held = True
        try:
            service = registry.get(pool, fence)  # (a pool made after a restored copy: proven first)
            s = service.session(request.session_id, fence)
            if request.abandoned:  # its client's given-up calls: tombstones first (its record has them)
                registry.idempotency.abandon(s.session_id, key, abandoned_calls(request))
            try:
                # (a copy of a call whose key is forgotten is refused by its call_sequence)
                kept = registry.idempotency.lookup(s.session_id, m.rpc, key, digest, request.call_sequence)
            except KeptRefusal:  # told again once the call's record is durable, as it was told
                held = False
                registry.locks.give(pool)
                await registry.recorder.durable()
                raise
            if kept is not None:  # (its fence stamped already, as the call's was)
                held = False
                registry.locks.give(pool)
                await registry.recorder.durable()
                # kept by a run with a larger max_message_bytes (a restart lowered it):
                # gRPC would refuse it without a reason, read as "nothing changed"
                unsendable = self._unsendable(m, kept, self.max_message_bytes)
                if unsendable is not None:
                    raise unsendable
                return kept
            service.answer_event_bytes = take_events_budget(self.max_message_bytes)
            if m.slices is None:
                answer = m.apply(service, s, request, service.fence, self.max_message_bytes)
            else:
                work = m.slices(service, s, request, service.fence, self.max_message_bytes, SLICE_OPS)
                end = time.perf_counter() + self.slice_seconds
                while True:
                    try:
                        next(work)
                    except StopIteration as done:
                        answer = done.value
                        break
                    if time.perf_counter() >= end:
                        # the task holds the pool now, and gives it back once journaled
                        task = asyncio.get_running_loop().create_task(
                            self._sliced(m, service, s, request, key, digest, body, work)
                        )
                        held = False
                        return await self._answer(await asyncio.shield(task))
        finally:
            if held:
                registry.locks.give(pool)
        # journaled and kept without an await since the pool was given back: nothing
        # else reads or changes it first (and a snapshot due now is not put off by it)
        return await self._answer(self._keep(m, service, s, request, key, digest, body, answer))

    async def _answer(self, result: bytes | ServiceError) -> bytes:
        """The answer's bytes once durable (its fence stamped already: :meth:`_keep`); a
        journaled error is raised once durable."""
        await self.committed()
        if isinstance(result, ServiceError):
            raise result
        return result

    async def _sliced(
        self, m: Mutation[A], service: PoolService, s: Session, request: Any, key: str, digest: bytes,
        body: bytes | None, work: Generator[None, None, A | ServiceError],
    ) -> bytes | ServiceError:  # fmt: skip
        """The rest of a sliced call, the pool held (given back once it is journaled)."""
        try:
            answer = await self.in_turns(work, freeze=True)
            parts = None
            if (
                not isinstance(answer, ServiceError)
                and len(getattr(answer, "results", ())) > SERIALIZE_SLICE_OPS
            ):
                # a large Step's results serialized in slices too, the pool still held
                # (its fence, stamped at once with the journal position, is encoded last)
                parts = await self.in_turns(repeated_slices(answer, "results", SERIALIZE_SLICE_OPS))
            return self._keep(m, service, s, request, key, digest, body, answer, parts)
        finally:
            self.registry.locks.give(service.name)

    def _keep(
        self, m: Mutation[A], service: PoolService, s: Session, request: Any, key: str, digest: bytes,
        body: bytes | None, answer: A | ServiceError, results: list[bytes] | None = None,
    ) -> bytes | ServiceError:  # fmt: skip
        """Journal an applied call and keep its answer under its key (no await); the
        call's own error is journaled too (it may have changed the pool), kept under its
        key (a retry or a late copy is told it again: idempotency.py) and returned. Returns
        the answer's bytes (its fence stamped: what :meth:`positioned` would add is
        there already). ``results``: the encoding of the answer's results, made already
        (:func:`repeated_slices`)."""
        registry = self.registry
        recorder = registry.recorder
        sequence = request.call_sequence  # (counted once its key is forgotten: idempotency.py)
        if isinstance(answer, ServiceError):
            # kept under its key (a retry, or a late copy, is told it again, never applied
            # after the pool changed), unless it says "retry later"
            if not key or answer.status is Status.UNAVAILABLE:
                key, digest = "", b""
            registry.idempotency.remember(s.session_id, m.rpc, key, digest, None, answer, sequence)
            recorder.called(service, m.rpc, request, key, digest, None, body)
            return answer
        journal = self._journal()
        if journal is not None and answer.HasField("fence"):
            # the record appended next is this call's: the answer is durable once it is
            # committed (durable waits for that), and a retry gets it byte for byte
            # (replay stamps the same position)
            answer.fence.position = journal.appended + 1  # type: ignore[attr-defined]
            self._tagged(answer.fence)  # type: ignore[attr-defined]
        kept_answer = answer.SerializeToString() if results is None else joined(answer, "results", results)
        unsendable = self._unsendable(m, kept_answer, self.max_message_bytes)
        if key:
            kept = None if unsendable is not None else kept_answer
            registry.idempotency.remember(s.session_id, m.rpc, key, digest, kept, sequence=sequence)
        recorder.called(service, m.rpc, request, key, digest, kept_answer, body)
        return kept_answer if unsendable is None else unsendable

    @staticmethod
    def _unsendable(m: Mutation[Any], answer: bytes, max_message_bytes: int) -> ServiceError | None:
        """The error told instead of an applied call's answer that gRPC would refuse to
        send (larger than ``max_message_bytes``; None: it fits). Its size is known only
        once applied (block tables, the pool's state decide it): sent anyway, the client
        would get RESOURCE_EXHAUSTED without a reason, read as "nothing changed", and a
        retry the same. It is journaled as applied, and its key kept as a tombstone
        (live and on replay), so a retry gets this same error, never the call again."""
        if not max_message_bytes or len(answer) <= max_message_bytes:
            return None
        return ServiceError(
            Status.ABORTED,
            f"the {m.rpc} was applied, but its answer ({len(answer):,} bytes) is larger than "
            f"max_message_bytes ({max_message_bytes:,}) and cannot be sent: treat the requests it named "
            "as lost (free them; send smaller Steps, or fewer operations that read block tables)",
            ErrorReason.ANSWER_EVICTED,
        )

    def _tagged(self, fence: Any) -> None:
        """Set a wire fence's ``position_tag`` for its instance and position (positions.py;
        none without the journal's key)."""
        fence.position_tag = self.registry.positions.tag(fence.instance_id, fence.position)

    def replay(
        self, m: Mutation[Any], body: bytes, key: str, digest: bytes, told: bytes | None, writer: str,
        position: int, age: float,
    ) -> str:  # fmt: skip
        """Apply a journaled call again (recovery; the registry records nothing then) as
        the call was applied: under the registry's journaled answer budget, answered with
        the fence of ``writer`` (the instance that answered it) and the record's
        ``position``; its answer must have the digest ``told`` (None: an error), and is
        kept under its key as made ``age`` seconds of serving time ago. Returns the pool.

        Raises:
            ValueError: the call is refused now, or answered otherwise than its client was.
        """
        registry = self.registry
        request = m.parse(body)
        service = registry.pools[request.pool]
        s = registry.sessions.sessions.get(request.session_id)
        if s is None:
            raise ValueError(
                f"replaying a {m.rpc} of pool {request.pool!r}: its session {request.session_id!r} was not "
                "attached or had ended before it: the journal does not match the server that wrote it"
            )
        budget = registry.max_message_bytes
        service.answer_event_bytes = take_events_budget(budget)
        try:
            store = registry.idempotency  # the tombstones it made live (run), at its time:
            store.as_of(
                age, lambda: store.abandon(s.session_id, key, abandoned_calls(request), replaying=True)
            )
            answer = m.apply(
                service, s, request, Fence(writer, service.fence.incarnation, term=service.fence.term), budget
            )
        except ServiceError as err:  # a refused call is never journaled: this one was applied
            raise ValueError(
                f"replaying a {m.rpc} of pool {request.pool!r} is refused ({err.message}) though its "
                "client was told it was applied: the journal does not match the server that wrote it"
            ) from None
        kept: bytes | None = None
        if not isinstance(answer, ServiceError):
            # as a live call's: its fence names the call's own record, tagged under the
            # writer's journal key (positions.py: this journal's, or the one a cluster
            # store's stream names; untagged by a kvcoord before tags; replay_tags)
            answer.fence.position = position
            for tag in registry.positions.replay_tags(writer, position):
                answer.fence.position_tag = tag
                kept = answer.SerializeToString()
                if answer_digest(kept) == told:
                    registry.positions.told_with(writer, position, tag)
                    break
        again = None if kept is None else answer_digest(kept)
        if again != told:
            what = "an error" if told is None else "an answer"
            got = "an error" if again is None else "a different answer"
            raise ValueError(
                f"replaying a {m.rpc} of pool {request.pool!r} gives {got} where its client was told {what}: "
                "the journal does not match this kvcoord's rules (records are replayed under the limits "
                "they were applied with); start the kvcoord version that wrote it"
            )
        sequence = request.call_sequence
        if key and isinstance(answer, ServiceError):  # a refusal kept live (_keep)
            self._remember_at(s.session_id, m.rpc, key, digest, None, age, sequence, answer)
        elif key and kept is not None:
            if self._unsendable(m, kept, budget) is not None:
                kept = None  # never sent: its key is a tombstone, as it was live (_keep)
            self._remember_at(s.session_id, m.rpc, key, digest, kept, age, sequence)
        return str(request.pool)

    def _remember_at(
        self, session_id: str, rpc: str, key: str, digest: bytes, kept: bytes | None, age: float,
        sequence: int, refusal: ServiceError | None = None,
    ) -> None:  # fmt: skip
        """Keep a replayed call's answer (or refusal) under its key, as made ``age``
        seconds of serving time ago (the keys older than the window then are forgotten,
        their call sequence numbers counted, as they were live)."""
        store = self.registry.idempotency
        store.as_of(age, lambda: store.remember(session_id, rpc, key, digest, kept, refusal, sequence))

    def _journal(self) -> Any:
        return getattr(self.registry.recorder, "journal", None)

    def kept_unjournaled(
        self, owner: str, rpc: str, request: Any, answer_type: type[A]
    ) -> tuple[bytes, A | None]:
        """A keyed call that is not a :class:`Mutation` (a reserving ScorePools: it has
        no session, its key is ``owner``'s): its request's digest, and the answer kept
        for its key (``None``: a new key, whose answer the caller keeps with
        :meth:`keep_unjournaled` once made). Such answers are not journaled: a restart
        forgets them, and what they made (a reservation) ends with it.

        Raises:
            ServiceError: as :meth:`IdempotencyStore.lookup` (KEY_REUSED, ...).
        """
        digest = request_digest(request)
        kept = self.registry.idempotency.lookup(owner, rpc, request.idempotency_key, digest)
        return digest, None if kept is None else answer_type.FromString(kept)

    def keep_unjournaled(self, owner: str, rpc: str, request: Any, digest: bytes, answer: Message) -> None:
        """Keep the answer of a call :meth:`kept_unjournaled` found new."""
        self.registry.idempotency.remember(
            owner, rpc, request.idempotency_key, digest, answer.SerializeToString(deterministic=True)
        )

    def record(self, note: Callable[[Recorder], None]) -> None:
        """Journal a change now, not waiting for the commit: one made without a call (a
        reservation's time ran out), or a call's that comes before a wait of its own (an
        exclusive Attach's session, before the engine's state is encoded; its end, when
        the answer cannot be sent)."""
        note(self.registry.recorder)

    async def durable(self, answer: A, record: Callable[[Recorder], None] | None = None) -> A:
        """Journal the call that made ``answer`` (``record``, given the recorder: the
        unkeyed mutating calls, after their change), then answer once every mutation so
        far is durable (durability.py)."""
        if record is not None:
            record(self.registry.recorder)
        await self.registry.recorder.durable()
        return self.positioned(answer)

    def answers_on(self, pool: str) -> None:
        """The running call's answer rests on ``pool``'s records, its own or not (an
        Attach retried under its attach_key answers with the first's session: Recorder.answers_on)."""
        self.registry.recorder.answers_on(pool)

    async def committed(self) -> None:
        """Return once every mutation recorded so far is durable (a refusal told after a
        change made without a call of its own: a lapsed session's end, servicer_core.py)."""
        await self.registry.recorder.durable()

    def positioned(self, answer: A) -> A:
        """Stamp the answer's fence with the journal position it is durable at (every
        record committed so far: positions.py) and its tag; clients send both back as
        proof. Answers of keyed calls carry their own record's position already."""
        if (
            "fence" in answer.DESCRIPTOR.fields_by_name
            and answer.HasField("fence")
            and not answer.fence.position  # type: ignore[attr-defined]
        ):
            self.positioned_fence(answer.fence)  # type: ignore[attr-defined]
        return answer

    def positioned_fence(self, fence: Any) -> Any:
        """Stamp a wire fence (in place; returned) as :meth:`positioned` stamps an
        answer's: every record committed so far, and its tag (none without a journal).
        A stream's messages (WatchEvents) carry it too: what a reader was told proves a
        restore as a worker's call does."""
        journal = self._journal()
        if journal is not None:
            fence.position = journal.committed
            self._tagged(fence)
        return fence
