"""One server per data directory (service/data_dir_lock.py), the lock itself: held
until released or until its process ends, however it ends."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvcoord.service.data_dir_lock import LOCK_FILE, DataDirInUseError, DataDirLock
from kvcoord.service.startup import DataDirError

ROOT = Path(__file__).resolve().parents[2]


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path: Path) -> None:
    first = DataDirLock.acquire(tmp_path)
    try:
        with pytest.raises(DataDirInUseError) as refused:
            DataDirLock.acquire(tmp_path)  # (another open file: flock refuses it in one process too)
        message = str(refused.value)
        assert f"data directory {tmp_path} is in use by another kvcoord server" in message
        assert f"pid {os.getpid()} on " in message
        assert isinstance(refused.value, DataDirError)  # (`serve` exits 3 on it)
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
    finally:
        first.release()
    assert not first.held
    second = DataDirLock.acquire(tmp_path)  # given back: taken at once
    second.release()
    second.release()  # (idempotent)


def test_the_lock_of_a_process_killed_with_sigkill_is_free_at_once(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time; from kvcoord.service.data_dir_lock import DataDirLock; "
            f"DataDirLock.acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(120)"
        )],
        stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}"),
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DataDirInUseError, match=f"pid {holder.pid} on "):
            DataDirLock.acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while True:  # (the kernel drops the lock as the process ends: at once, bounded here)
        try:
            lock = DataDirLock.acquire(tmp_path)
            break
        except DataDirInUseError:
            assert time.monotonic() < deadline, "the lock outlived its SIGKILLed holder"
            time.sleep(0.05)
    lock.release()


def test_an_unusable_lock_file_is_a_data_dir_error(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).mkdir()  # (not a file: it cannot be opened for writing)
    with pytest.raises(DataDirError, match="cannot open the data directory's lock"):
        DataDirLock.acquire(tmp_path)


def test_a_file_system_that_cannot_lock_is_a_data_dir_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``flock`` is not supported (ENOLCK, EOPNOTSUPP) the server cannot promise it
    is alone on the directory: a DataDirError (exit 3) naming the error, the file closed."""

    def cannot(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", cannot)
    opened = len(os.listdir("/proc/self/fd"))
    with pytest.raises(DataDirError, match="cannot lock the data directory's lock .*No locks available"):
        DataDirLock.acquire(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == opened
