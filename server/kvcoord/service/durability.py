"""What the service tells the journal: every mutation, as its inputs.

The engine is deterministic, so replaying the inputs of every mutation, in the order
they were applied, into fresh engines rebuilds the exact state: free-queue order,
reference counts, hashes, requests, statistics, event sequence numbers, session
cursors and idempotency answers. The journal records what changed state, never what
a caller was told: an answer (other workers' events and token ids included) is
rebuilt on replay from the replayed state, and only its digest is kept, to prove the
replay gave the client the same answer. Records are CBOR lists ``[kind, wall_time, ...]``:

============  =================================================================
``start``     instance id (a later instance recovered this history; fences that
              name it stay valid; the records after it were written by it)
``limits``    the server limits from here on (a dict of :class:`Limits` fields):
              records are replayed under the limits they were applied with
``create``    pool name, wire ``PoolConfig`` bytes, incarnation, creation wall time
``delete``    pool name
``attach``    pool, session id, client name, lease seconds, exclusive, tenant, and its
              attach key when it has one (or ``""``) and ``True`` when the Attach
              reset the pool's prefix cache as the session started (replayed so)
``detach``    session id
``expire``    session id (its lease ran out; its requests were freed)
``call``      rpc (Step, Allocate, Free), wire request bytes, idempotency key,
              request digest, answer digest (BLAKE2b-128 of the answer's bytes;
              ``None``: its client was told an error, an Allocate's refusal with
              ``must_succeed``)
``reset``     pool name (ResetPrefixCache RPC)
``reserve``   pool name, reservation id, num_tokens, block hashes, tenant (ScorePools
              with reserve_seconds; a recovered reservation has no time left: the
              server releases it at once, recording ``unreserve``)
``unreserve`` pool name, reservation id (its time ran out; adoption by a request is
              part of that request's ``call``)
``adopt``     a pool another replica handed over, or rebuilt from the cluster store
              (registry_state.dump_pool's value: its engine state, events, sessions
              and their kept answers, lineage, the records of earlier instances it
              holds), and the last records of earlier instances of this journal it
              brought that this journal lacked (instance id -> position: positions.py,
              ``JournalPositions.brought``)
``term``      pool name, term: the pool's ownership term in a cluster from here on
              (answers' fences carry it)
``restored``  the instances voided (a list of instance ids: those the journal named,
              and the one whose fence proved the restore; absent in older
              journals), and the generation it begins (instances started after it tag
              under that generation's key; absent in older journals): the journal was found behind what clients were told: fences of
              every earlier instance are void from here on, and none of those
              instances' fences proves a restore again (positions.py; every
              session's ``expire``, every reservation's ``unreserve`` and every
              pool's ``reset`` record follow; grace.json holds the grace before it)
============  =================================================================

Lease renewals are not journaled: a recovered session gets a fresh lease.

:class:`Recorder` records nothing (durability ``none``); :class:`JournalRecorder`
appends to a :class:`~kvcoord.service.journal_writer.Journal` and takes a snapshot every
``snapshot_every`` records without stopping the event loop: the process forks (a
copy-on-write image of the state, a few milliseconds), the child encodes the state
(registry_state.py's ``dump_state``, plain values) into a file beside the journal and
exits, and the journal's writer thread copies that file into the journal in chunks
between record commits (journal.py). Handlers await :meth:`Recorder.durable` before
an answer leaves.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import gc
import hashlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cbor2

from .journal_cbor import Encoded, record_bytes
from .pool_service import ABANDONED, ABANDONED_PAST_RESERVATIONS
from .sessions import attach_tail

if TYPE_CHECKING:  # pragma: no cover
    from google.protobuf.message import Message

    from .events import EventJournal
    from .journal_writer import Journal
    from .pool_service import PoolService
    from .sessions import Session

__all__ = [
    "ABANDONED",
    "ABANDONED_PAST_RESERVATIONS",
    "JournalRecorder",
    "Recorder",
    "answer_digest",
    "decode_record",
    "leave_parent",
    "write_snapshot_file",
]

logger = logging.getLogger(__name__)

#: the temporary files snapshots are encoded into: ``snapshot-<seq>.part`` (``.tmp`` while written)
SNAPSHOT_FILE_GLOB = "snapshot-*.part*"


def answer_digest(answer: bytes) -> bytes:
    """What the journal keeps of an answer (recovery compares the replayed one's)."""
    return hashlib.blake2b(answer, digest_size=16).digest()


class Recorder:
    """Told about every mutation; this one (durability ``none``) records nothing."""

    def started(self, instance_id: str) -> None:
        pass

    def limits_changed(self, limits: dict[str, int]) -> None:
        pass

    def pool_created(self, service: PoolService) -> None:
        pass

    def pool_deleted(self, name: str) -> None:
        pass

    def attached(self, service: PoolService, s: Session) -> None:
        pass

    def detached(self, service: PoolService, session_id: str) -> None:
        pass

    def session_expired(self, session_id: str, pool: str = "", service: PoolService | None = None) -> None:
        """``pool``: the session's (not journaled locally; the store journal needs it);
        ``service``: that pool held here, whose events of the session's end (BlockRemoved
        of its abandoned requests) its readers see once the record is durable."""

    def called(
        self, service: PoolService, rpc: str, request: Message, key: str, digest: bytes, answer: bytes | None,
        body: bytes | None = None,
    ) -> None:  # fmt: skip
        """``answer``: the answer's bytes, or ``None`` when its client was told an error;
        ``body``: the request serialized already (else it is serialized here)."""

    def prefix_cache_reset(self, service: PoolService) -> None:
        pass

    def restored(self, settled: Sequence[str] = (), generation: int = 0) -> None:
        """``settled``: the instances whose fences prove nothing from here on; ``generation``:
        the one it begins (positions.py)."""

    def adopted(
        self,
        value: dict[str, Any],
        service: PoolService,
        ends: dict[str, int] | None = None,
        encoded: bytes | None = None,
    ) -> None:
        """A pool handed over by another replica (registry_state.dump_pool's value),
        loaded here as ``service``: its events are watchers' once the record is durable.
        ``ends``: earlier instances of this journal whose records the pool brought up to
        there (rebuilt from the cluster store, here or before a handover: positions.py,
        JournalPositions.brought). ``encoded``: ``value``'s CBOR, journaled as it is
        (encoding a large pool's value held the loop: pool_load.py)."""

    def term_changed(self, service: PoolService) -> None:
        """The pool's ownership term (its fence's) changed."""

    def reserved(
        self, service: PoolService, reservation_id: str, num_tokens: int, hashes: Sequence[bytes], tenant: str
    ) -> None:
        pass

    def reservation_released(self, service: PoolService, reservation_id: str) -> None:
        pass

    def pools_idle(self) -> None:
        """No pool is held any more (pool_locks.py): what waited for that may run."""

    def answers_on(self, pool: str) -> None:
        """The running call's answer rests on ``pool``'s records: its own, or a kept
        answer's whose record may still be on its way (the store journal then fails
        its :meth:`durable` when they could not be written)."""

    async def durable(self) -> None:
        """Return once every mutation recorded so far is durable."""


def decode_record(body: bytes) -> list[Any]:
    """A record's fields: ``[kind, wall_time, ...]``."""
    record = cbor2.loads(body)
    if not isinstance(record, list) or len(record) < 2 or not isinstance(record[0], str):
        raise ValueError("not a kvcoord journal record")
    return record


def write_snapshot_file(dump: Callable[[], Any], path: Path) -> None:
    """Encode ``dump()`` as CBOR into ``path`` (written whole, then renamed into place;
    a write that fails, a full disk, removes what it wrote: :func:`_partial`)."""
    tmp = _partial(path)
    try:
        with open(tmp, "wb") as f:
            cbor2.dump(dump(), f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _partial(path: Path) -> Path:
    """The file a snapshot is written into before it is renamed ``path``."""
    return path.with_name(path.name + ".tmp")


def leave_parent(parent: int, keep: int = -1) -> None:
    """In a forked child (a snapshot, state_export.py): die with the parent (a
    SIGKILLed server must not leave a child behind), and close every inherited
    descriptor but ``keep`` (the gRPC listeners above all: a child holding a port the
    restarted server binds again would take its calls)."""
    gc.disable()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent died before that
            os._exit(1)
    if keep >= 3:
        os.closerange(3, keep)
        os.closerange(keep + 1, _max_fd())
    else:
        os.closerange(3, _max_fd())


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 65536


def _fork_snapshot(dump: Callable[[], Any], path: Path) -> int:
    """Fork a child that writes the state as it is now into ``path`` and exits; returns
    its pid. The parent goes on at once: the child reads a copy-on-write image."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: no event loop, no gRPC, no journal; only this
        leave_parent(parent)
        write_snapshot_file(dump, path)
        code = 0
    except BaseException:
        try:
            os.write(2, f"kvcoord snapshot child failed:\n{traceback.format_exc()}".encode())
        except BaseException:
            pass
    finally:
        os._exit(code)
    return 0  # pragma: no cover - never reached


def _never() -> bool:
    return False


class JournalRecorder(Recorder):
    """Appends every mutation to ``journal``.

    Args:
        journal: the group-commit journal.
        snapshot_every: records between snapshots.
        dump: the whole state as plain values, for snapshots (registry_state.dump_state).
        fingerprint: names the snapshot format (registry_state.snapshot_fingerprint).
        wall_clock: seconds since the epoch (record times: idempotency windows).
        fork: take snapshots in a forked child (default: where ``os.fork`` exists and
            gRPC's fork handlers are off, see ``kvcoord/service/__init__.py``);
            otherwise the state is dumped on the loop (a stall that grows with the
            state) and encoded by a thread.
    """

    def __init__(
        self,
        journal: Journal,
        snapshot_every: int,
        dump: Callable[[], Any],
        fingerprint: str,
        wall_clock: Callable[[], float] = time.time,
        fork: bool | None = None,
    ) -> None:
        self.journal = journal
        self.snapshot_every = snapshot_every
        self.dump = dump
        self.fingerprint = fingerprint
        self.wall_clock = wall_clock
        if fork is None:
            from . import FORK_SAFE

            fork = FORK_SAFE and hasattr(os, "fork") and sys.platform != "win32"
        self.fork = fork
        self.since_snapshot = 0
        #: while this is true no snapshot starts (the next record, or the pools falling
        #: idle, tries again: :meth:`pools_idle`): a pool is mid-Step (pool_locks.py),
        #: and a snapshot would hold half of it
        self.paused: Callable[[], bool] = _never
        #: snapshots taken (written into the journal)
        self.snapshots = 0
        self.snapshot_failures = 0
        #: the snapshot being taken (a task that ends once it is in the journal)
        self.snapshot_task: asyncio.Task[None] | None = None
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcoord-snapshot")
        #: (journal seq, pool events, their last sequence then): events become visible
        #: to watchers once the record is committed
        self._marks: collections.deque[tuple[int, EventJournal, int]] = collections.deque()
        journal.on_commit.append(self._committed)

    def _append(self, *fields: object, service: PoolService | None = None) -> None:
        body = record_bytes((fields[0], self.wall_clock(), *fields[1:]))  # cbor2.dumps of the list
        seq = self.journal.append(body)
        self._also(fields, seq, body, service)
        if service is not None:
            self._marks.append((seq, service.events, service.events.last_sequence))
        self.since_snapshot += 1
        if self.since_snapshot >= self.snapshot_every:
            self.snapshot()

    def _also(self, fields: tuple[object, ...], seq: int, body: bytes, service: PoolService | None) -> None:
        """Told of each record appended (the store journal copies pools' records)."""

    def snapshot(self) -> asyncio.Task[None] | None:
        """Start a snapshot of the state after the last appended record (unless one is
        being taken: the next record tries again). Returns the task that ends once it
        is in the journal, or None."""
        if self.snapshot_task is not None and not self.snapshot_task.done():
            return None
        if self.journal.failed is not None or self.paused():
            return None
        seq = self.journal.appended
        path = self.journal.store.path.with_name(f"snapshot-{seq}.part")
        pid = 0
        if self.fork:
            try:
                pid = _fork_snapshot(self.dump, path)
            except OSError as exc:  # a pids limit, memory: the call whose record this is was applied
                logger.warning("cannot fork to take a snapshot (%s): taken on the loop", exc)
        if pid:
            work: Callable[[], None] = lambda: _wait_child(pid, path)  # noqa: E731
        else:
            value = self.dump()
            work = lambda: write_snapshot_file(lambda: value, path)  # noqa: E731
        self.since_snapshot = 0
        self.snapshot_task = asyncio.get_running_loop().create_task(self._finish_snapshot(seq, path, work))
        return self.snapshot_task

    def pools_idle(self) -> None:
        """Take the snapshot a held pool put off. A Step applied in slices appends its
        record with its pool still held, so that record starts no snapshot; were this
        not tried again once the pools are idle, a workload of such Steps (long
        prefills, large decode batches, any batch on a loaded server) would never be
        snapshotted: the journal, and the replay at the next start, would grow without
        bound."""
        if self.since_snapshot >= self.snapshot_every:
            self.snapshot()

    async def _finish_snapshot(self, seq: int, path: Path, work: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._waiter, work)
            await self.journal.add_snapshot(seq, self.fingerprint, path)
        except Exception as exc:  # the records are still there: recovery replays them
            self.snapshot_failures += 1
            logger.error("snapshot after record %d failed (the journal keeps its records): %s", seq, exc)
            path.unlink(missing_ok=True)
            _partial(path).unlink(missing_ok=True)  # a child that died writing it (killed, OOM)
            return
        self.snapshots += 1

    async def final_snapshot(self) -> None:
        """Take a snapshot of the state now and wait until it is in the journal (a clean
        stop: the next start then replays nothing)."""
        await self.durable()
        if self.snapshot_task is not None:
            await asyncio.shield(self.snapshot_task)
        if self.journal.appended > self.journal.snapshot_seq:
            task = self.snapshot()
            if task is not None:
                await task

    def close(self) -> None:
        self._waiter.shutdown(wait=False)

    def _committed(self, seq: int) -> None:
        marks = self._marks
        while marks and marks[0][0] <= seq:
            _, events, last = marks.popleft()
            events.mark_durable(last)

    def started(self, instance_id: str) -> None:
        self._append("start", instance_id)

    def limits_changed(self, limits: dict[str, int]) -> None:
        self._append("limits", limits)

    def pool_created(self, service: PoolService) -> None:
        service.events.durable_sequence = service.events.last_sequence
        wire: Any = service.wire_config
        self._append(
            "create", service.name, wire.SerializeToString(), service.fence.incarnation, service.created_at
        )

    def pool_deleted(self, name: str) -> None:
        self._append("delete", name)

    def attached(self, service: PoolService, s: Session) -> None:
        # a reset with the Attach is its record's (replayed before the session starts): two
        # records would let a snapshot fall between them
        self._append(
            "attach", service.name, s.session_id, s.client_name, s.lease_seconds, s.exclusive, s.tenant,
            *attach_tail(s), service=service if s.reset_at_attach else None,
        )  # fmt: skip

    def detached(self, service: PoolService, session_id: str) -> None:
        self._append("detach", session_id, ABANDONED_PAST_RESERVATIONS, service=service)

    def session_expired(self, session_id: str, pool: str = "", service: PoolService | None = None) -> None:
        self._append("expire", session_id, ABANDONED_PAST_RESERVATIONS, service=service)

    def called(
        self, service: PoolService, rpc: str, request: Message, key: str, digest: bytes, answer: bytes | None,
        body: bytes | None = None,
    ) -> None:  # fmt: skip
        self._append(
            "call",
            rpc,
            request.SerializeToString() if body is None else body,
            key,
            digest,
            None if answer is None else answer_digest(answer),
            service=service,
        )

    def prefix_cache_reset(self, service: PoolService) -> None:
        self._append("reset", service.name, service=service)

    def restored(self, settled: Sequence[str] = (), generation: int = 0) -> None:
        self._append("restored", list(settled), generation)

    def adopted(
        self,
        value: dict[str, Any],
        service: PoolService,
        ends: dict[str, int] | None = None,
        encoded: bytes | None = None,
    ) -> None:
        field: object = value if encoded is None else Encoded(encoded)
        if ends:
            self._append("adopt", field, ends, service=service)
        else:
            self._append("adopt", field, service=service)

    def term_changed(self, service: PoolService) -> None:
        self._append("term", service.name, service.fence.term)

    def reserved(
        self, service: PoolService, reservation_id: str, num_tokens: int, hashes: Sequence[bytes], tenant: str
    ) -> None:
        self._append("reserve", service.name, reservation_id, num_tokens, list(hashes), tenant)

    def reservation_released(self, service: PoolService, reservation_id: str) -> None:
        self._append("unreserve", service.name, reservation_id)

    async def durable(self) -> None:
        await self.journal.flush()


def _wait_child(pid: int, path: Path) -> None:
    """Wait for a snapshot child (on a thread).

    Raises:
        RuntimeError: the child failed (its traceback went to stderr).
    """
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not path.exists():
        raise RuntimeError(f"the snapshot process exited with {code}")
