"""The stall tests' probe (loop_monitor.py) counts the work the loop does in one go, not
time the machine took the thread away: a CPU-bound callback of 150 ms is a 150 ms stall;
a loop thread descheduled for as long (here: asleep in a blocking call, which costs no
CPU, as a descheduled thread does) is seen in ``max_wall`` only."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvcoord.service.testing import InProcessServer
from loop_monitor import LoopMonitor


def _held(server: InProcessServer, hold: Callable[[], None]) -> LoopMonitor:
    monitor = LoopMonitor(server)
    time.sleep(0.05)
    monitor.reset()
    assert server.loop is not None
    server.loop.call_soon_threadsafe(hold)
    time.sleep(0.3)
    monitor.stop()
    return monitor


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_work_on_the_loop_is_a_stall(make_server: Callable[..., InProcessServer]) -> None:
    monitor = _held(make_server(), lambda: _spin(0.15))
    assert monitor.max_gap >= 0.14, monitor.max_gap
    assert monitor.max_wall >= 0.14, monitor.max_wall


def test_time_without_the_cpu_is_not(make_server: Callable[..., InProcessServer]) -> None:
    monitor = _held(make_server(), lambda: time.sleep(0.15))
    assert monitor.max_wall >= 0.14, monitor.max_wall
    assert monitor.max_gap < 0.05, monitor.max_gap
