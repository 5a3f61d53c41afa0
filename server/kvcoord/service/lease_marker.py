"""The lease marker: how a restarted server knows leases of its predecessor may still run.

A server with a ``state_dir`` records there, before it grants or renews any lease,
a wall-clock time by which every lease it granted has ended. A server that starts
and finds a marker in the future hands out no block until that time: a worker that
lost its server stops using its block ids when its lease ends (it knows when it last
renewed), so after that no id can be held by two live workers.

The bound is written with headroom (``max_lease`` past the lease that moved it). Once
half the headroom is used, it is moved forward on a thread of its own, so a busy
server writes it about twice per ``max_lease`` seconds and its event loop never waits
for those fsyncs (a slow disk took seconds each, and every pool's calls waited). Only
when a lease would pass the bound on disk (the thread's write not done within half
the headroom, or failed) is the marker written on the caller's thread, after any
write in flight. The invariant either way: a lease is granted only inside the bound
already synced to disk (:attr:`LeaseMarker.recorded`), and the bound on disk never
moves back: every write of the file, by any instance in this process, is made
under one lock and keeps at least the bound it replaces. A SIGKILL while a write is
in flight leaves the file as it was (it is replaced atomically), which covers every
lease granted; a process ending normally waits for the write (the thread is not a
daemon). A server stopping joins the thread (:meth:`LeaseMarker.close`) before it gives
the data directory's lock back, so no write of this instance can land once another
server may hold the directory; one not done within the bound keeps the lock until the
process ends (after the write: the thread is not a daemon).

The bound is written on the wall clock and on the monotonic clock with the boot id
(deadlines.DurableDeadline): a restart on the same boot counts on the monotonic clock,
so a wall clock set forward in between cannot end the wait early.

A marker that cannot be written (disk full, I/O error) means the server can no longer
promise when its leases end: :meth:`LeaseMarker.cover` raises :class:`MarkerWriteError`
and the server stops serving as after a failed journal write (``server.py``). A write
that does not return (a hung disk) is bounded as a journal commit is (stalls.py,
``[server] journal_stall_seconds``, :attr:`LeaseMarker.stall_seconds`): the thread's
write once outstanding that long, or a write the caller needs (made on a thread of its
own, the caller waiting at most the bound), raises :class:`MarkerStalledError` and
marks the marker :attr:`~LeaseMarker.hung` (the process then exits without waiting for it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .deadlines import DurableDeadline, write_synced
from .stalls import join_bounded, stalled_message

__all__ = ["LeaseMarker", "MarkerError", "MarkerStalledError", "MarkerWriteError"]

logger = logging.getLogger(__name__)

FILE_NAME = "leases.json"


#: marker file -> the lock every write of it in this process is made under (a stopped
#: instance's write still in flight, and the next instance's on the same directory)
_WRITING: dict[str, threading.RLock] = {}
_WRITING_GUARD = threading.Lock()


def _writing_lock(path: Path) -> threading.RLock:
    with _WRITING_GUARD:
        return _WRITING.setdefault(os.path.abspath(path), threading.RLock())


class MarkerError(RuntimeError):
    """The marker file exists but cannot be read; the message names it."""


class MarkerWriteError(OSError):
    """The marker could not be written: no lease may be granted or renewed."""


class MarkerStalledError(MarkerWriteError):
    """A write of the marker did not return within :attr:`LeaseMarker.stall_seconds`."""


class LeaseMarker:
    """Args:
    state_dir: the server's state directory (created if missing).
    max_lease: the longest lease this server grants, in seconds.
    clock: wall-clock seconds (time.time), injected for tests.
    mono: monotonic seconds (time.monotonic), injected for tests.
    boot: the boot id (deadlines.boot_id), injected for tests.
    """

    def __init__(
        self,
        state_dir: str | Path,
        max_lease: float,
        clock: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
        boot: str | None = None,
    ) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.max_lease = max_lease
        self.clock = clock
        self.deadline = DurableDeadline(clock, mono, boot)
        #: the bound synced to disk, on the monotonic clock: no lease is granted past it
        self.recorded = float("-inf")
        self._writing = _writing_lock(self.path)
        #: the thread moving the bound forward (None: none yet)
        self._refresher: threading.Thread | None = None
        #: its last write failed: none is started again until a write on the caller's
        #: thread succeeds (that one raises MarkerWriteError if it fails too)
        self._refresh_failed = False
        #: when the thread's write began (time.monotonic: a stall is in real time)
        self._refresh_began = 0.0
        #: closed (the server stops): no thread is started again
        self._closed = False
        #: a write outstanding longer than this fails the marker (None: waits for ever;
        #: the server sets [server] journal_stall_seconds)
        self.stall_seconds: float | None = None
        #: True once a write did not return in time: neither :meth:`close` nor the
        #: process's exit may wait for it (main.py)
        self.hung = False
        self._stall: MarkerStalledError | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def previous_leases_remaining(self) -> float | None:
        """Seconds until the previous instance's leases have all ended (<= 0: they have),
        or None without a marker.

        Raises:
            MarkerError: the file is unreadable or malformed.
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise MarkerError(f"cannot read lease marker {self.path}: {exc}") from None
        try:
            data = json.loads(text)
            if "until_wall" not in data:  # written by an older kvcoord: wall clock only
                data = {"until_wall": data["leases_end_by"]}
            return self.deadline.remaining(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MarkerError(
                f"lease marker {self.path} is malformed ({exc}); if no worker of the previous "
                "instance can still be running, delete it"
            ) from None

    def cover(self, lease_seconds: float) -> None:
        """Make sure the marker covers a lease granted or renewed now.

        A lease inside the bound on disk returns at once (past half the headroom, after
        starting the thread that moves the bound forward); one past it is written here,
        on the caller's thread (atomically, synced), once any write in flight is done.

        Raises:
            MarkerWriteError: the marker cannot be written (the lease must not be granted).
        """
        if self._stall is not None:
            raise self._stall
        self._check_refresher()
        end = self.deadline.mono() + lease_seconds
        if end <= self.recorded:
            if end > self.recorded - self.max_lease / 2:
                self._refresh(lease_seconds)
            return
        if self.stall_seconds is None:
            self._write_past(lease_seconds)
        else:  # on a thread of its own: the caller (the event loop) waits at most the bound
            failed: list[BaseException] = []
            writer = threading.Thread(
                target=self._write_past, args=(lease_seconds, failed), name="kvcoord-lease-marker-cover"
            )
            writer.start()
            if not join_bounded(writer, self.stall_seconds):
                raise self._stalled()
            if failed:
                raise failed[0]
        self._refresh_failed = False

    def _write_past(self, lease_seconds: float, failed: list[BaseException] | None = None) -> None:
        """Write a bound covering a lease from now, once any write in flight is done
        (which may cover it)."""
        try:
            with self._writing:
                if self.deadline.mono() + lease_seconds <= self.recorded:
                    return
                self.write(lease_seconds + self.max_lease)
        except MarkerWriteError as exc:
            if failed is None:
                raise
            failed.append(exc)

    def _check_refresher(self) -> None:
        """The thread's write outstanding past the bound is a stall (after the one more
        brief wait of the policy: a process paused past the bound)."""
        refresher = self._refresher
        if self.stall_seconds is None or refresher is None or not refresher.is_alive():
            return
        waited = time.monotonic() - self._refresh_began
        if waited > self.stall_seconds and not join_bounded(refresher, self.stall_seconds, waited):
            raise self._stalled()

    def _stalled(self) -> MarkerStalledError:
        assert self.stall_seconds is not None
        self.hung = True
        self._stall = MarkerStalledError(
            errno.EIO, stalled_message(f"a write of lease marker {self.path}", self.stall_seconds)
        )
        logger.error("lease marker stalled, no lease is granted or renewed: %s", self._stall)
        return self._stall

    def close(self, timeout: float) -> bool:
        """No thread moves the bound forward from now on, and the one at it (if any) is
        waited for, at most ``timeout`` seconds: False if its write is still in flight
        (the data directory must then stay held until the process ends)."""
        self._closed = True
        refresher = self._refresher
        if refresher is None:
            return True
        if self.hung:  # (it may never end)
            return not refresher.is_alive()
        refresher.join(timeout)
        return not refresher.is_alive()

    def _refresh(self, lease_seconds: float) -> None:
        """Move the bound forward on a thread (unless one is at it, or failed last, or
        the marker is closed)."""
        if (
            self._closed
            or self._refresh_failed
            or (self._refresher is not None and self._refresher.is_alive())
        ):
            return
        self._refresher = threading.Thread(
            target=self._refreshing, args=(lease_seconds,), name="kvcoord-lease-marker"
        )
        self._refresh_began = time.monotonic()
        self._refresher.start()

    def _refreshing(self, lease_seconds: float) -> None:
        try:
            self.write(lease_seconds + self.max_lease)
        except MarkerWriteError as exc:
            self._refresh_failed = True
            logger.warning(
                "%s; the bound is written on the event loop when a lease reaches it (the lease is "
                "refused and the server stops if that fails too)", exc,
            )  # fmt: skip

    def write(self, seconds_from_now: float) -> None:
        """Record that every lease ends within ``seconds_from_now``, or by the bound on
        disk now if that is later (the file never moves back), and raise
        :attr:`recorded` to what was synced; under the file's write lock.

        Raises:
            MarkerWriteError: naming the file and the error.
        """
        with self._writing:
            try:
                # the bound this instance synced, or another one in this process (a
                # stopped server's write that was in flight): never replaced by an earlier one
                already = self.previous_leases_remaining()
            except MarkerError:
                already = None
            seconds = max(seconds_from_now, self.recorded - self.deadline.mono(), already or 0.0)
            fields = self.deadline.fields(seconds)
            try:
                write_synced(self.path, json.dumps({**fields, "leases_end_by": fields["until_wall"]}))
            except OSError as exc:
                raise MarkerWriteError(
                    exc.errno, f"cannot write lease marker {self.path}: {exc.strerror or exc}"
                ) from exc
            self.recorded = max(self.recorded, float(fields["until_mono"]))
