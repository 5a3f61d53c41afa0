"""A pool's journal in the cluster store (``[cluster] journal = "store"``).

With the local journal only, a pool lives and dies with its replica's disk. With ``journal =
"store"`` every record of a pool is also written to etcd, under the pool's key prefix, before
its answer leaves, so that another replica can rebuild the pool when its owner dies (cluster.py,
:meth:`Cluster.recover_orphans`).

**Streams.** A pool's records form one *stream per term* (the revision of the
owner's claim, ownership.py)::

    /kvcoord/<cluster>/journal/<pool>/<term:020d>/<seq:020d>/<part:06d>/<parts:06d>

Each stream starts with a ``base`` record (seq 0): the pool's whole state as
:func:`~kvcoord.service.registry_state.dump_pool` makes it, with the instance that writes the
stream, the limits its records are applied with and the fence key of the writer's local journal.
The records after it are the pool's records of the local journal (``attach``, ``call``,
``detach``, ...), each with its local journal position (answers' fences name it, with its tag
under that key, so replay must too: positions.py).
Every ``snapshot_every`` records a new ``base`` is written into the stream, and once it is
committed every key of the pool before it (older records, older terms' streams) is deleted: the
log stays bounded. A large pool's base is encoded by a forked child (state_export.py: the pool's
image right after the record that made it due) while the loop goes on; the stream writes it, and
the records after it, once it is there.

**Guard.** Every write is one etcd transaction that compares the claim's ``mod_revision`` with
the stream's term: once another replica holds the claim (a new term), the deposed owner's writes
fail, so it never acknowledges anything after losing the pool. A write whose outcome is unknown
(the store did not answer) is retried while the replica's lease is sure to be alive and for at
most ``journal_stall_seconds`` (stalls.py), one the store refuses (out of space) is not; then
the pool is given up here (:attr:`PoolStreams.on_lost`): its calls get UNAVAILABLE (a copy of a
call waiting on the kept answer too), and whoever claims it next rebuilds it from the store.

**Size.** etcd refuses requests above 1.5 MiB (``--max-request-bytes``) and transactions of more
than 128 operations (``--max-txn-ops``). A record is cut into parts of :data:`PART_BYTES` (512
KiB); a transaction carries at most :data:`TXN_BYTES` (1 MiB) of values and :data:`TXN_OPS`
operations, so a large record (a base snapshot) spans several transactions. A record counts only
once all its parts are there; an answer is sent only once all of them are committed.

**Events.** A pool's KV events are shown to watchers only once the record that made
them is committed both locally and in the store (:class:`StoreRecorder`), so no
watcher sees an event the next owner, rebuilt from the store, would not have.

**Rebuilding** (store_rebuild.py, :func:`~.store_rebuild.rebuild`): the highest term whose stream has a complete
``base`` is taken; its latest complete base is loaded into a scratch registry and the
records after it replayed there (recovery.py's :class:`~.recovery.Replayer`, with the
digests of what clients were told checked), and the result is the pool's state as a
handover carries it. It runs in a forked child (a thread where the process may not
fork), so the replica's lease and its other pools' calls go on meanwhile
(:func:`~.store_rebuild.rebuilt_apart`); the pool is loaded only while the claim it was
rebuilt for is still the replica's (cluster_recover.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import cbor2

from .durability import JournalRecorder
from .errors import ServiceError, Status
from .stalls import run_bounded, stalled_message
from .store_failures import GivenUp, Mark, refused
from .tasks import uncancelled

if TYPE_CHECKING:  # pragma: no cover
    from .pool_service import PoolService

__all__ = ["PART_BYTES", "PoolStreams", "StoreRecorder", "StoreWriteError", "encode_base", "encode_item"]

logger = logging.getLogger(__name__)

#: bytes of a record per key
PART_BYTES = 512 << 10
#: bytes of values per transaction (etcd's default request limit is 1.5 MiB)
TXN_BYTES = 1 << 20
#: operations per transaction (etcd's default --max-txn-ops is 128)
TXN_OPS = 64
#: seconds between retries of a write whose outcome is unknown
RETRY_SECONDS = 0.1
#: the pools the running task's answer rests on (records it queued, a kept answer's),
#: each with the records settled and queued and its stream's term when it was marked: a
#: record of the pool given up since fails its flush, unless of a stream it had left
#: (a pool whose records could not be written fails only its calls; store_failures.py)
_TOUCHED: contextvars.ContextVar[dict[str, Mark] | None] = contextvars.ContextVar(
    "kvcoord_store_pools", default=None
)


class StoreWriteError(Exception):
    """A pool's records could not be written (claim gone, store refused or unreachable)."""


@dataclasses.dataclass(slots=True)
class _Stream:
    term: int
    next_seq: int = 0
    since_base: int = 0


#: a record's body, or (a large pool's base) the body being encoded off the loop
Body: TypeAlias = "bytes | Awaitable[bytes]"


@dataclasses.dataclass(frozen=True, slots=True)
class _Item:
    gseq: int
    pool: str
    term: int
    seq: int
    body: Body
    base: bool


def _parts(body: bytes) -> list[bytes]:
    return [body[i : i + PART_BYTES] for i in range(0, len(body), PART_BYTES)] or [b""]


class PoolStreams:
    """Writes pools' records to the store, a transaction per batch, guarded by the term.

    Args:
        client: the etcd client (aetcd), read at each write (set once connected).
        prefix: the cluster's key prefix (``/kvcoord/<cluster>/``).
        lease_valid: whether this replica's lease is sure to be alive (writes whose
            outcome is unknown are retried while it is).
        snapshot_every: records of a pool between its base snapshots.
    """

    def __init__(
        self,
        client: Callable[[], Any],
        prefix: bytes,
        lease_valid: Callable[[], bool],
        snapshot_every: int,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.lease_valid = lease_valid
        self.snapshot_every = snapshot_every
        self.streams: dict[str, _Stream] = {}
        self.appended = 0
        self.committed = 0
        self._pending: list[_Item] = []
        self._failed = GivenUp()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        #: told when a pool's records could not be written (it must not be served here)
        self.on_lost: Callable[[str], None] | None = None
        #: told after each batch is settled (committed, or failed and given up)
        self.on_commit: list[Callable[[], None]] = []
        #: a transaction outstanding longer than this is given up (None: retried while
        #: the lease is sure to be alive; the server sets [server] journal_stall_seconds)
        self.stall_seconds: float | None = None
        #: transactions written, bytes written (bench, metrics)
        self.txns = 0
        self.bytes = 0

    # -- keys ----------------------------------------------------------------------
    def pool_prefix(self, pool: str) -> bytes:
        return self.prefix + b"journal/" + pool.encode() + b"/"

    def owner_key(self, pool: str) -> bytes:
        return self.prefix + b"owners/" + pool.encode()

    def _record_key(self, pool: str, term: int, seq: int) -> bytes:
        return self.pool_prefix(pool) + f"{term:020d}/{seq:020d}/".encode()

    # -- what the recorder tells ---------------------------------------------------------
    def is_open(self, pool: str) -> bool:
        return pool in self.streams

    def open(self, pool: str, term: int, base: Body) -> None:
        """Start ``pool``'s stream of ``term`` with ``base`` (its whole state now)."""
        self.streams[pool] = _Stream(term)
        self.append(pool, base, base=True)

    def close(self, pool: str) -> None:
        """The pool is no longer here (deleted, handed over, lost): no more records."""
        self.streams.pop(pool, None)

    def append(self, pool: str, body: Body, base: bool = False) -> bool:
        """Queue a record of ``pool`` (ignored when its stream is not open). Returns
        True when the stream is due for a new base. A body still being encoded (an
        awaitable: a large pool's base, state_export.py) is awaited when written; the
        pool's records after it wait for it, and a body that fails loses the pool here."""
        stream = self.streams.get(pool)
        if stream is None:
            return False
        self.answers_on(pool)
        self.appended += 1
        self._pending.append(_Item(self.appended, pool, stream.term, stream.next_seq, body, base))
        stream.next_seq += 1
        stream.since_base = 0 if base else stream.since_base + 1
        self._kick()
        return stream.since_base >= self.snapshot_every

    def answers_on(self, pool: str) -> None:  # (StoreRecorder.answers_on)
        if pool not in (marks := _TOUCHED.get() or {}):
            stream = self.streams.get(pool)
            term = stream.term if stream is not None else None
            _TOUCHED.set({**marks, pool: Mark(self.committed, self.appended, term)})

    async def flush(self) -> None:
        """Wait until every record queued so far is committed in the store.

        Raises:
            ServiceError: UNAVAILABLE when a record of a pool marked by this task since its last
                flush (:meth:`answers_on`) was given up since it was marked, even before this flush
                began, or may have been (pruned away: store_failures.py); not for the records of
                a term the pool's stream had left when marked (a rebuild's flush was failed by
                the old term's, deposed); the pool is given up here, its next owner has what was
                committed.
        """
        target = self.appended
        marks = _TOUCHED.get() or {}
        if self.committed < target:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(
                (min((m.settled for m in marks.values()), default=self.committed), target, future)
            )
            await future
        lost = self._failed.lost(marks, target)  # (a record pruned away it cannot tell of: lost too)
        if marks:  # settled: a later flush of this task checks the pools marked again only
            _TOUCHED.set(None)
        if lost:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"the journal of pool(s) {', '.join(p[:200] for p in lost)!s} could not be written to the "
                "cluster store (this replica lost the claim or the store): retry, the pool's owner answers",
            )

    # -- writing ---------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        """Write what is queued, batch by batch, until nothing is. Whatever ends it
        before it settled everything (cancelled at the loop's shutdown, a fault of
        ours) first gives up every pool of what it had not settled (those records may
        or may not be in the store): their flushes end with UNAVAILABLE, never wait
        for a loop that is gone (they used to wait forever)."""
        batch: list[_Item] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                await self._write(batch)
                self._settled(batch[-1].gseq)
                batch = []
        except BaseException as exc:
            unsettled, self._pending = [*batch, *self._pending], []
            if unsettled:
                self._give_up(unsettled, exc)
                self._settled(unsettled[-1].gseq)
            if not isinstance(exc, Exception):
                raise  # cancelled
            logger.exception("the store journal's write loop failed (its pools are given up here)")

    async def _write(self, batch: list[_Item]) -> None:
        by_pool: dict[str, list[_Item]] = {}
        for item in batch:
            by_pool.setdefault(item.pool, []).append(item)
        results = await asyncio.gather(
            *(self._write_pool(pool, items) for pool, items in by_pool.items()), return_exceptions=True
        )
        for items, result in zip(by_pool.values(), results, strict=True):
            if isinstance(result, BaseException):
                self._give_up(items, result)

    def _give_up(self, items: list[_Item], exc: BaseException) -> None:
        """``items`` may not be in the store: their pools are not served here (on_lost), their flushes fail."""
        by_pool: dict[str, list[_Item]] = {}
        for item in items:
            by_pool.setdefault(item.pool, []).append(item)
        for pool, mine in by_pool.items():
            logger.error("the journal of pool %s could not be written to the store: %r", pool, exc)
            self._failed.add(pool, ((i.gseq, i.term) for i in mine))
            stream = self.streams.get(pool)
            if stream is not None and any(i.term == stream.term for i in mine):  # (its stream's now)
                self.close(pool)
                if self.on_lost is not None:
                    try:
                        self.on_lost(pool)
                    except Exception:  # noqa: BLE001 - logged; the stream is closed: nothing more is acknowledged
                        logger.exception("giving pool %s up failed", pool)

    def _settled(self, gseq: int) -> None:
        """Every record up to ``gseq`` is committed or given up: wake their flushes."""
        self.committed = gseq
        keep = []
        for start, target, w in self._waiters:
            if target <= gseq:
                if not w.done():
                    w.set_result(None)
            else:
                keep.append((start, target, w))
        self._waiters = keep
        for fn in self.on_commit:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a listener's fault: the writes go on (it used to end them)
                logger.exception("a listener of the store journal's commits failed")
        self._failed.prune(min((s for s, _, _ in self._waiters), default=self.committed))

    async def _write_pool(self, pool: str, items: list[_Item]) -> None:
        """Write ``items`` (one pool's, in order) in guarded transactions; after a base, delete what it covers."""
        term = items[0].term
        if any(i.term != term for i in items):  # a new stream began: the old one's first, on its own
            split = next(n for n, i in enumerate(items) if i.term != term)
            try:  # (was: its failure, deposed as it is once claimed again, gave the new base up)
                await self._write_pool(pool, items[:split])
            except Exception as exc:  # noqa: BLE001 - its flushes fail; the new stream goes on
                self._give_up(items[:split], exc)
            await self._write_pool(pool, items[split:])
            return
        txns: list[list[tuple[bytes, bytes]]] = [[]]
        size = 0
        bases = []
        for item in items:
            body = item.body if isinstance(item.body, bytes) else await item.body
            parts = _parts(body)
            key = self._record_key(pool, term, item.seq)
            if item.base:
                bases.append(item.seq)
            for n, part in enumerate(parts):
                if txns[-1] and (len(txns[-1]) >= TXN_OPS or size + len(part) > TXN_BYTES):
                    txns.append([])
                    size = 0
                txns[-1].append((key + f"{n:06d}/{len(parts):06d}".encode(), part))
                size += len(part)
        for puts in txns:
            await self._txn(pool, term, puts, None)
        if bases:
            # everything of the pool before the latest base: older records, older terms
            await self._txn(pool, term, [], (self.pool_prefix(pool), self._record_key(pool, term, bases[-1])))

    async def _txn(
        self, pool: str, term: int, puts: list[tuple[bytes, bytes]], delete: tuple[bytes, bytes] | None
    ) -> None:
        """One guarded transaction, retried while its outcome is unknown; not done within
        :attr:`stall_seconds` (stalls.py) it is given up as a refused one is."""
        if not await run_bounded(self._txn_retried(pool, term, puts, delete), self.stall_seconds):
            what = f"a write of pool {pool!r}'s journal to the cluster store"  # (outcome unknown)
            raise StoreWriteError(stalled_message(what, self.stall_seconds or 0.0))

    async def _txn_retried(
        self, pool: str, term: int, puts: list[tuple[bytes, bytes]], delete: tuple[bytes, bytes] | None
    ) -> None:
        while True:
            client = self.client()
            if client is None:
                raise StoreWriteError("not connected to the cluster store")
            tx = client.transactions
            success = [tx.put(k, v) for k, v in puts]
            if delete is not None:
                success.append(tx.delete(delete[0], range_end=delete[1]))
            compare = [tx.mod(self.owner_key(pool)) == term]
            try:  # (a replaced client's channel closed under the write: CallCancelled, retried)
                ok, _ = await uncancelled(client.transaction(compare=compare, success=success, failure=[]))
            except Exception as exc:  # noqa: BLE001 - outcome unknown: the same write again is harmless
                if refused(exc) or not self.lease_valid():  # (a refusal was retried: callers hung)
                    raise StoreWriteError(
                        f"the store refused the write or did not answer in time: {exc!r}"
                    ) from None
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if not ok:
                raise StoreWriteError(f"the claim of pool {pool!r} is no longer term {term} (deposed)")
            self.txns += 1
            self.bytes += sum(len(v) for _, v in puts)
            return


def encode_item(local_seq: int, record_body: bytes) -> bytes:
    """A stream record: the local journal position it was answered at, and the record."""
    return cbor2.dumps([local_seq, cbor2.loads(record_body)])


def encode_base(
    value: dict[str, Any], writer: str, limits: dict[str, int], wall: float, fence_key: bytes | None
) -> bytes:
    """A stream's base record (``fence_key``: the writer's journal's, positions.py)."""
    return cbor2.dumps([0, ["base", wall, value, writer, limits, fence_key]])


#: record kinds copied into a pool's stream that name their pool, and where
_POOL_FIELD = {"attach": 1, "reset": 1, "reserve": 1, "unreserve": 1, "term": 1}


class StoreRecorder(JournalRecorder):
    """The local journal's recorder that also copies each pool's records into its
    stream in the store, and answers only once both are committed.

    Set :attr:`streams` and :attr:`dump_base` before the cluster starts (server.py).
    """

    streams: PoolStreams | None = None
    #: the base record of a pool now (its state, writer and limits), encoded
    dump_base: Callable[[str], Body] | None = None
    #: the pool of the session whose expiry is being recorded
    _expiring: str | None = None
    #: the last record committed locally
    _local_committed = 0
    #: local record -> the store write it waits for too (its pool's events are shown
    #: to watchers only once both are committed: never an event the next owner lacks)
    _store_at: dict[int, int] | None = None

    def attach_streams(self, streams: PoolStreams, dump_base: Callable[[str], Body]) -> None:
        """Copy pools' records to ``streams`` from now on."""
        self.streams = streams
        self.dump_base = dump_base
        self._store_at = {}
        streams.on_commit.append(self._release)

    def _also(self, fields: tuple[object, ...], seq: int, body: bytes, service: PoolService | None) -> None:
        streams = self.streams
        if streams is None:
            return
        try:
            self._copy(fields, seq, body, service, streams)
        finally:
            if service is not None and self._store_at is not None:
                self._store_at[seq] = streams.appended

    def _committed(self, seq: int) -> None:
        self._local_committed = seq
        self._release()

    def _release(self) -> None:
        """Show watchers the events of records committed both here and in the store."""
        marks, waits = self._marks, self._store_at
        while marks and marks[0][0] <= self._local_committed:
            seq = marks[0][0]
            if waits is not None:
                if self.streams is not None and waits.get(seq, 0) > self.streams.committed:
                    return
                waits.pop(seq, None)
            _, events, last = marks.popleft()
            events.mark_durable(last)

    def _copy(
        self,
        fields: tuple[object, ...],
        seq: int,
        body: bytes,
        service: PoolService | None,
        streams: PoolStreams,
    ) -> None:
        kind = fields[0]
        pool: str | None = None
        if kind in ("call", "detach") and service is not None:
            pool = service.name
        elif kind in _POOL_FIELD:
            pool = str(fields[_POOL_FIELD[kind]])
        elif kind == "expire":
            pool = self._expiring
        if pool is None or not streams.is_open(pool):
            return
        if streams.append(pool, encode_item(seq, body)) and self.dump_base is not None:
            streams.append(pool, self.dump_base(pool), base=True)

    def answers_on(self, pool: str) -> None:
        if self.streams is not None:  # (a kept answer's record: a copy of a call must fail as its original)
            self.streams.answers_on(pool)

    def session_expired(self, session_id: str, pool: str = "", service: PoolService | None = None) -> None:
        self._expiring = pool
        try:
            super().session_expired(session_id, pool, service)
        finally:
            self._expiring = None

    def open_stream(self, service: PoolService) -> None:
        """The pool's term changed here (claimed, adopted, taken over): a new stream."""
        if self.streams is None or self.dump_base is None:
            return
        stream = self.streams.streams.get(service.name)
        if stream is not None and stream.term == service.fence.term:
            return
        self.streams.open(service.name, service.fence.term, self.dump_base(service.name))

    def term_changed(self, service: PoolService) -> None:
        self.open_stream(service)
        super().term_changed(service)

    def pool_deleted(self, name: str) -> None:
        super().pool_deleted(name)
        if self.streams is not None:
            self.streams.close(name)

    async def durable(self) -> None:
        await super().durable()
        if self.streams is not None:
            await self.streams.flush()
