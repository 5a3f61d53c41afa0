"""SIGSTOP a process and wait until it is really stopped.

``kill(pid, SIGSTOP)`` only starts a group stop: the kernel wakes one thread to take the
signal, and the process's other threads run on until that thread has been scheduled and
stopped the group. On a loaded machine that took longer than a whole call (etcd's other
threads committed a write sent after the ``kill``: state "R" in /proc both before and
after that call's answer; 219 of 300 kills at load 19 left a thread running, for up to
385 ms). A test that SIGSTOPs a process to freeze it (a paused VM, a partition, a volume
snapshot) stops it with :func:`stop_process`, which returns only once no thread runs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["STOP_SECONDS", "stop_process"]

#: seconds a SIGSTOPped process is waited for until all its threads are stopped
STOP_SECONDS = 30.0


def stop_process(pid: int, timeout: float = STOP_SECONDS) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (or it has exited).

    Raises:
        ProcessLookupError: there is no process ``pid`` (it was reaped).
        TimeoutError: not every thread stopped within ``timeout`` seconds (SIGCONT sent).
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while (running := _running_threads(pid)) and time.monotonic() < deadline:
        time.sleep(0.005)
    if running:
        os.kill(pid, signal.SIGCONT)
        raise TimeoutError(f"threads {running} of process {pid} were not stopped {timeout} s after SIGSTOP")


def _state(stat: Path) -> str:
    """A task's state letter from its /proc ``stat`` file (after the command's ``)``)."""
    return stat.read_text().rsplit(")", 1)[1].split()[0]


def _running_threads(pid: int) -> list[int]:
    """The threads of ``pid`` not stopped (their state in /proc: neither stopped nor gone).
    A process that exited (a zombie not yet reaped, or gone) has none."""
    try:
        if _state(Path(f"/proc/{pid}/stat")) in ("Z", "X"):
            return []
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):  # reaped meanwhile
        return []
    running = []
    for task in tasks:
        try:
            state = _state(task / "stat")
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        if state not in ("T", "t") and not (state in ("Z", "X") and int(task.name) != pid):
            running.append(int(task.name))
    return running
