"""What the service tells the journal: every acknowledged mutation, as its inputs.

The engine is deterministic, so replaying the inputs of every mutation, in the order
they were applied, into fresh engines rebuilds the exact state: free-queue order,
reference counts, hashes, requests, statistics, event sequence numbers, session
cursors and idempotency answers. Records are CBOR lists ``[kind, wall_time, ...]``:

============  =================================================================
``start``     instance id (a later instance recovered this history; fences that
              name it stay valid)
``create``    pool name, wire ``PoolConfig`` bytes, incarnation, creation wall time
              (absent in older journals: the record's own time)
``delete``    pool name
``attach``    pool, session id, client name, lease seconds, exclusive, tenant
``detach``    session id
``expire``    session id (its lease ran out; its requests were freed)
``call``      rpc (Step, Allocate, Free), wire request bytes, idempotency key,
              digest, answer bytes (every answered call, keyed or not: recovery
              compares each replayed call with it; journals written before this
              rule hold None for keyless calls, replayed unchecked)
``reset``     pool name (ResetPrefixCache RPC)
``reserve``   pool name, reservation id, num_tokens, block hashes, tenant (ScorePools
              with reserve_seconds; a recovered reservation has no time left: the
              server releases it at once, recording ``unreserve``)
``unreserve`` pool name, reservation id (its time ran out; adoption by a request is
              part of that request's ``call``)
``restored``  (none) the journal was found behind what clients were told: fences of
              every earlier instance are void from here on (the recovered sessions'
              ``expire`` and the pools' ``reset`` records follow)
============  =================================================================

Lease renewals are not journaled: a recovered session gets a fresh lease.

:class:`Recorder` records nothing (durability ``none``); :class:`JournalRecorder`
appends to a :class:`~kvcoord.service.journal.Journal`, takes a snapshot every
``snapshot_every`` records, and tells each pool's event journal which events are
durable. Handlers await :meth:`Recorder.durable` before an answer leaves.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cbor2

if TYPE_CHECKING:  # pragma: no cover
    from google.protobuf.message import Message

    from .events import EventJournal
    from .journal import Journal
    from .pool_service import PoolService
    from .sessions import Session

__all__ = ["JournalRecorder", "Recorder", "decode_record"]


class Recorder:
    """Told about every mutation; this one (durability ``none``) records nothing."""

    def started(self, instance_id: str) -> None:
        pass

    def pool_created(self, service: PoolService) -> None:
        pass

    def pool_deleted(self, name: str) -> None:
        pass

    def attached(self, service: PoolService, s: Session) -> None:
        pass

    def detached(self, service: PoolService, session_id: str) -> None:
        pass

    def session_expired(self, session_id: str) -> None:
        pass

    def called(
        self, service: PoolService, rpc: str, request: Message, key: str, digest: bytes, answer: Message
    ) -> None:
        pass

    def prefix_cache_reset(self, service: PoolService) -> None:
        pass

    def restored(self) -> None:
        pass

    def reserved(
        self, service: PoolService, reservation_id: str, num_tokens: int, hashes: Sequence[bytes], tenant: str
    ) -> None:
        pass

    def reservation_released(self, service: PoolService, reservation_id: str) -> None:
        pass

    async def durable(self) -> None:
        """Return once every mutation recorded so far is durable."""


def decode_record(body: bytes) -> list[Any]:
    """A record's fields: ``[kind, wall_time, ...]``."""
    record = cbor2.loads(body)
    if not isinstance(record, list) or len(record) < 2 or not isinstance(record[0], str):
        raise ValueError("not a kvcoord journal record")
    return record


class JournalRecorder(Recorder):
    """Appends every mutation to ``journal``.

    Args:
        journal: the group-commit journal.
        snapshot_every: records between snapshots.
        dump: returns (fingerprint, bytes) of the whole state, for snapshots.
        wall_clock: seconds since the epoch (record times: idempotency windows).
    """

    def __init__(
        self,
        journal: Journal,
        snapshot_every: int,
        dump: Callable[[], tuple[str, bytes]],
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.journal = journal
        self.snapshot_every = snapshot_every
        self.dump = dump
        self.wall_clock = wall_clock
        self.since_snapshot = 0
        self.snapshots = 0
        self.bytes_appended = 0
        #: (journal seq, pool events, their last sequence then): events become visible
        #: to watchers once the record is committed
        self._marks: collections.deque[tuple[int, EventJournal, int]] = collections.deque()
        journal.on_commit.append(self._committed)

    def _append(self, *fields: object, service: PoolService | None = None) -> None:
        body = cbor2.dumps([fields[0], self.wall_clock(), *fields[1:]])
        self.bytes_appended += len(body)
        seq = self.journal.append(body)
        if service is not None:
            self._marks.append((seq, service.events, service.events.last_sequence))
        self.since_snapshot += 1
        if self.since_snapshot >= self.snapshot_every:
            self.snapshot()

    def snapshot(self) -> None:
        """Queue a snapshot of the state after the last appended record."""
        fingerprint, body = self.dump()
        self.journal.snapshot(fingerprint, body)
        self.since_snapshot = 0
        self.snapshots += 1

    def _committed(self, seq: int) -> None:
        marks = self._marks
        while marks and marks[0][0] <= seq:
            _, events, last = marks.popleft()
            events.mark_durable(last)

    def started(self, instance_id: str) -> None:
        self._append("start", instance_id)

    def pool_created(self, service: PoolService) -> None:
        service.events.durable_sequence = service.events.last_sequence
        wire: Any = service.wire_config
        self._append(
            "create", service.name, wire.SerializeToString(), service.fence.incarnation, service.created_at
        )

    def pool_deleted(self, name: str) -> None:
        self._append("delete", name)

    def attached(self, service: PoolService, s: Session) -> None:
        self._append(
            "attach", service.name, s.session_id, s.client_name, s.lease_seconds, s.exclusive, s.tenant
        )

    def detached(self, service: PoolService, session_id: str) -> None:
        self._append("detach", session_id, service=service)

    def session_expired(self, session_id: str) -> None:
        self._append("expire", session_id)

    def called(
        self, service: PoolService, rpc: str, request: Message, key: str, digest: bytes, answer: Message
    ) -> None:
        self._append(
            "call",
            rpc,
            request.SerializeToString(),
            key,
            digest,
            answer.SerializeToString(),
            service=service,
        )

    def prefix_cache_reset(self, service: PoolService) -> None:
        self._append("reset", service.name, service=service)

    def restored(self) -> None:
        self._append("restored")

    def reserved(
        self, service: PoolService, reservation_id: str, num_tokens: int, hashes: Sequence[bytes], tenant: str
    ) -> None:
        self._append("reserve", service.name, reservation_id, num_tokens, list(hashes), tenant)

    def reservation_released(self, service: PoolService, reservation_id: str) -> None:
        self._append("unreserve", service.name, reservation_id)

    async def durable(self) -> None:
        await self.journal.flush()
