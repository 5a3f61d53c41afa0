"""A probe on an in-process server's event loop: the longest it stood still.

A task on the server's loop sleeps ``tick`` seconds again and again; any lateness of
a wake-up is time the loop was held by something else (one call applied at once, a
collector pass). Used by the stall tests: a bound well above what the sliced work
holds it, well below what the work held it at once."""

from __future__ import annotations

import asyncio
import time

from kvcoord.service.testing import InProcessServer

__all__ = ["LoopMonitor"]


class LoopMonitor:
    """Started on construction; :meth:`stop` returns the longest stall seen (seconds)."""

    def __init__(self, server: InProcessServer, tick: float = 0.002) -> None:
        assert server.loop is not None
        self.tick = tick
        self.max_gap = 0.0
        self._stop = False
        self._done = asyncio.run_coroutine_threadsafe(self._run(), server.loop)

    async def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            await asyncio.sleep(self.tick)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last - self.tick)
            last = now

    def reset(self) -> None:
        """Forget the stalls seen so far (the probe's own start)."""
        self.max_gap = 0.0

    def stop(self) -> float:
        self._stop = True
        self._done.result(5)
        return self.max_gap
