"""A probe on an in-process server's event loop: the longest it stood still.

A task on the server's loop sleeps ``tick`` seconds again and again; the loop thread's
CPU time between two wake-ups is time the loop was held by something else (one call
applied at once, a collector pass). CPU time, not the wall clock: on a loaded machine
(CI's two cores shared by three test workers) the thread is descheduled for tens of
milliseconds at a time, which no code of the server's can avoid; the wall-clock gap is
kept too (``max_wall``), for messages. Used by the stall tests: a bound well above what
the sliced work holds it, well below what the work held it at once."""

from __future__ import annotations

import asyncio
import time

from kvcoord.service.testing import InProcessServer

__all__ = ["LoopMonitor"]


class LoopMonitor:
    """Started on construction; :meth:`stop` returns the longest stall seen (seconds of
    the loop thread's CPU between two wake-ups)."""

    def __init__(self, server: InProcessServer, tick: float = 0.002) -> None:
        assert server.loop is not None
        self.tick = tick
        self.max_gap = 0.0
        self.max_wall = 0.0
        self._stop = False
        self._done = asyncio.run_coroutine_threadsafe(self._run(), server.loop)

    async def _run(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()  # (the loop's thread)
        while not self._stop:
            await asyncio.sleep(self.tick)
            now, cpu = time.perf_counter(), time.thread_time()
            self.max_wall = max(self.max_wall, now - last - self.tick)
            self.max_gap = max(self.max_gap, cpu - last_cpu)
            last, last_cpu = now, cpu

    def reset(self) -> None:
        """Forget the stalls seen so far (the probe's own start)."""
        self.max_gap = self.max_wall = 0.0

    def stop(self) -> float:
        self._stop = True
        self._done.result(5)
        return self.max_gap
