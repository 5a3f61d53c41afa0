"""Group commit of the journal (:class:`Journal`) on an asyncio loop: handlers append
records (synchronously, in the order they mutate state) and await
:meth:`Journal.flush`; one task writes everything appended so far in one transaction
on a worker thread (:class:`~.journal.JournalStore`) while new records accumulate for
the next one. Snapshots are copied in a chunk per commit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .journal import JournalError, JournalStore, SnapshotChunk
from .stalls import stalled_message, wait_bounded

__all__ = ["SNAPSHOT_CHUNK_BYTES", "Journal", "JournalStalledError"]

logger = logging.getLogger(__name__)

#: bytes of a snapshot written per transaction
SNAPSHOT_CHUNK_BYTES = 16 << 20


def _chunks(seq: int, fingerprint: str, path: Path) -> Iterator[SnapshotChunk]:
    """The chunks of the snapshot file ``path`` (read on the writer thread)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        part = 0
        body = f.read(SNAPSHOT_CHUNK_BYTES)
        while True:
            digest.update(body)
            after = f.read(SNAPSHOT_CHUNK_BYTES)
            yield SnapshotChunk(seq, part, body, None if after else (fingerprint, digest.digest()))
            if not after:
                return
            part += 1
            body = after


class JournalStalledError(JournalError):
    """A commit did not return within the journal's bound (``stall_seconds``): a hung
    disk or fsync. Handled as a failed write: nothing after it is acknowledged."""


class Journal:
    """Group commit over a :class:`JournalStore` for handlers on one asyncio loop.

    :meth:`append` numbers a record and queues it; :meth:`flush` returns once
    everything appended before the call is committed. A failed write fails every
    waiter and every later flush (state in memory is then ahead of the disk: the
    server must be restarted, which recovers the committed prefix); :attr:`on_failure`
    tells the server, which stops serving and exits (``server.py``, ``main.py``).
    A commit still outstanding after :attr:`stall_seconds` fails the same way
    (:class:`JournalStalledError`); its writer thread is then left behind (:attr:`hung`).
    """

    def __init__(self, store: JournalStore, first_seq: int) -> None:
        self.store = store
        self.appended = first_seq
        self.committed = first_seq
        self.failed: BaseException | None = None
        #: the record the latest snapshot in the journal covers
        self.snapshot_seq = 0
        self._pending: list[tuple[int, bytes]] = []
        #: the snapshot being copied in: its chunks, the file, and who waits for it
        self._snapshot: tuple[Iterator[SnapshotChunk], Path, asyncio.Future[None]] | None = None
        self._compacting = False
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcoord-journal")
        #: called on the loop after each commit with the last committed seq
        self.on_commit: list[Callable[[int], None]] = []
        #: called on the loop after each commit of records with how long it took, from
        #: the batch leaving for the writer thread to its sync (metrics.py)
        self.on_commit_seconds: list[Callable[[float], None]] = []
        #: called on the loop once, when a write fails (the server must stop serving)
        self.on_failure: list[Callable[[BaseException], None]] = []
        #: a commit outstanding longer than this fails the journal (None: waits forever;
        #: the server sets [server] journal_stall_seconds)
        self.stall_seconds: float | None = None
        #: True once a commit did not return in time: the writer thread may never end, so
        #: neither :meth:`close` nor the process's exit may wait for it (main.py)
        self.hung = False

    def append(self, body: bytes) -> int:
        """Queue a record; returns its sequence number."""
        self.appended += 1
        self._pending.append((self.appended, body))
        self._kick()
        return self.appended

    async def add_snapshot(self, seq: int, fingerprint: str, path: Path) -> None:
        """Copy the snapshot file ``path`` (the state after record ``seq``) into the
        journal, a chunk per commit, then delete the file; returns once it is complete
        (the records it covers are gone then).

        Raises:
            JournalError: the journal failed meanwhile.
            RuntimeError: a snapshot is already being copied in.
        """
        if self.failed is not None:
            raise JournalError(f"journal {self.store.path} failed: {self.failed}")
        if self._snapshot is not None:
            raise RuntimeError("a snapshot is already being written")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._snapshot = (_chunks(seq, fingerprint, path), path, done)
        self._kick()
        try:
            await done
        finally:
            path.unlink(missing_ok=True)
        self.snapshot_seq = max(self.snapshot_seq, seq)

    async def flush(self) -> None:
        """Wait until every record appended so far is committed.

        Raises:
            JournalError: the journal could not be written.
        """
        if self.failed is not None:
            raise JournalError(f"journal {self.store.path} failed: {self.failed}") from self.failed
        target = self.appended
        if self.committed >= target:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        await future

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._commit_loop())

    def _write(
        self, batch: list[tuple[int, bytes]], snapshot: Iterator[SnapshotChunk] | None
    ) -> SnapshotChunk | OSError | None:
        """One commit on the writer thread: the batch, with the next chunk of
        ``snapshot`` if one is being copied in; after a snapshot, a compaction step
        follows each commit until it is done. Returns the chunk written."""
        chunk = None
        if snapshot is not None:
            try:
                chunk = next(snapshot)
            except OSError as exc:  # the snapshot file, not the journal: only the snapshot fails
                self.store.write(batch, None)
                return exc
        if batch or chunk is not None:
            self.store.write(batch, chunk)
        if self._compacting and chunk is None:  # a slice per commit: never starved by load
            self._compacting = self.store.compact_step()
        return chunk

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while (self._pending or self._snapshot is not None or self._compacting) and self.failed is None:
            batch, self._pending = self._pending, []
            snapshot = self._snapshot
            t0 = time.perf_counter()
            work = loop.run_in_executor(
                self._executor, self._write, batch, None if snapshot is None else snapshot[0]
            )
            try:
                chunk = work.result() if await wait_bounded(work, self.stall_seconds) else None
            except GeneratorExit:  # the coroutine closed (its loop gone): not a write failure
                raise
            except BaseException as exc:  # disk full, I/O error: nothing after this is durable
                logger.critical("journal write failed, no further mutation is acknowledged: %s", exc)
                self._fail(exc)
                return
            if not work.done():  # the commit has not returned: a hung disk or fsync
                self.hung = True
                work.add_done_callback(_ignore)  # should it ever end, its outcome is moot
                assert self.stall_seconds is not None  # (no bound: the wait above never ends early)
                stalled = JournalStalledError(stalled_message("a journal commit", self.stall_seconds))
                logger.error(
                    "journal %s stalled, no further mutation is acknowledged: %s", self.store.path, stalled
                )
                self._fail(stalled)
                return
            if snapshot is not None and isinstance(chunk, OSError):
                self._snapshot = None
                if not snapshot[2].done():
                    snapshot[2].set_exception(chunk)
            elif snapshot is not None and isinstance(chunk, SnapshotChunk) and chunk.last is not None:
                self._snapshot = None
                self._compacting = True
                if not snapshot[2].done():
                    snapshot[2].set_result(None)
            if batch:
                self.committed = batch[-1][0]
            keep = []
            for target, w in self._waiters:
                if target <= self.committed:
                    if not w.done():
                        w.set_result(None)
                else:
                    keep.append((target, w))
            self._waiters = keep
            for callback in self.on_commit:
                callback(self.committed)
            if batch:
                took = time.perf_counter() - t0
                for timed in self.on_commit_seconds:
                    timed(took)

    def _fail(self, exc: BaseException) -> None:
        """The journal failed: tell the server, then every waiter (nothing more commits)."""
        self.failed = exc
        for failed in self.on_failure:  # first: health turns before any caller hears
            failed(exc)
        err = JournalError(f"journal {self.store.path} failed: {exc}")
        for _, w in self._waiters:
            if not w.done():
                w.set_exception(err)
        self._waiters.clear()
        if self._snapshot is not None and not self._snapshot[2].done():
            self._snapshot[2].set_exception(err)
        self._snapshot = None

    async def close(self) -> None:
        """Commit what is pending, then close the file (after a stalled commit: neither,
        the file is still in the hung writer thread's hands)."""
        if self._task is not None:
            try:
                await self._task
            except BaseException:  # pragma: no cover - already logged
                pass
        if self.hung:
            self._executor.shutdown(wait=False)
            return
        if self._pending and self.failed is None:
            await self.flush()
        self._executor.shutdown(wait=True)
        self.store.close()


def _ignore(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
