"""One server per data directory: an exclusive lock held for the server's life.

Two servers on one data directory each recover the same journal, then each hands out
blocks from its own copy of the pools and appends its own records to the one journal:
a block could be live in two requests at once, and the next start replays two
interleaved histories (or finds the snapshot damaged). A Kubernetes rollout that
starts a new pod before the old one ended on the same volume, a container started
twice with one volume, a second ``kvcoord serve`` by hand: each did exactly that.

The server takes ``kvcoord.lock`` in the data directory with ``flock`` (exclusive,
non-blocking) before it reads anything there, and keeps it until it stops. The kernel
releases it when the process ends however it ends (SIGKILL, OOM), so a restart never
waits for it; a second server finds it held and refuses to start
(:class:`DataDirInUseError`, exit 3), naming the holder the file describes (its pid,
host and start time, written once the lock is held). ``flock`` holds between
processes of one kernel: every container of one host mounting the volume, and a
network file system whose client maps it onto its own locks (NFSv4).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from .startup import DataDirError

__all__ = ["LOCK_FILE", "DataDirInUseError", "DataDirLock"]

LOCK_FILE = "kvcoord.lock"


class DataDirInUseError(DataDirError):
    """Another server holds the data directory's lock; the message names it."""


class DataDirLock:
    """The exclusive lock of one data directory, held by this server
    (:meth:`acquire`) until :meth:`release` or the end of the process."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: str | Path) -> DataDirLock:
        """Hold ``data_dir``'s lock (the directory exists).

        Raises:
            DataDirInUseError: another server holds it (named when the file says who).
            DataDirError: the lock file cannot be opened or locked.
        """
        path = Path(data_dir) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DataDirError(f"cannot open the data directory's lock {path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise DataDirInUseError(
                f"data directory {path.parent} is in use by another kvcoord server ({holder}); "
                "one data directory serves one server at a time: stop that one first, or give this "
                "one its own server.data_dir (KVCOORD_DATA_DIR)"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise DataDirError(f"cannot lock the data directory's lock {path}: {exc}") from None
        _describe(fd)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the lock back (the server stopped, or did not start). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def _describe(fd: int) -> None:
    """Write who holds the lock into its file, for a server refused to name it (not
    synced: after a crash nobody holds it, and the next holder rewrites it)."""
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    except OSError:
        pass  # (only the refusal's message is poorer: the lock itself is held)


def _holder(fd: int) -> str:
    """The holder the lock file describes, as words (or that it does not say)."""
    try:
        fields = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(fields['pid'])} on {fields['host']}, since {fields['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder is not recorded"
