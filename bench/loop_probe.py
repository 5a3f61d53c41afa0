"""How long a server's event loop is held in one stretch (bench/stall.py's probe).

    python bench/loop_probe.py OUT serve [kvcoord serve's arguments]

runs ``kvcoord serve`` (of whatever ``kvcoord`` PYTHONPATH names) with one more task
on its event loop: it wakes every millisecond and notes, at each wake-up, the CPU
time the loop's thread spent since the previous one (``time.thread_time``). A
stretch longer than a millisecond or two is the loop held by one piece of work
(another machine's load does not count: waiting for a CPU is not CPU time). A thread
appends ``(time.monotonic(), stretch seconds)`` pairs (doubles) to OUT every 0.1 s;
:func:`read` reads them back. Not a test.
"""

from __future__ import annotations

import array
import asyncio
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any


def read(path: str) -> list[tuple[float, float]]:
    """The ``(monotonic time of the wake-up, CPU seconds since the previous)`` pairs."""
    a = array.array("d")
    with open(path, "rb") as f:
        data = f.read()
    a.frombytes(data[: len(data) // 16 * 16])
    return list(zip(a[::2], a[1::2], strict=True))


def _install(out: str) -> None:
    noted = array.array("d")
    lock = threading.Lock()

    async def probe() -> None:
        last = time.thread_time()
        while True:
            await asyncio.sleep(0.001)
            cpu = time.thread_time()
            with lock:
                noted.extend((time.monotonic(), cpu - last))
            last = cpu

    def writer() -> None:
        with open(out, "ab", buffering=0) as f:
            while True:
                time.sleep(0.1)
                with lock:
                    data = noted.tobytes()
                    del noted[:]
                f.write(data)

    threading.Thread(target=writer, daemon=True).start()
    run = asyncio.run

    async def probed(coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.get_running_loop().create_task(probe())
        try:
            return await coro
        finally:
            task.cancel()

    asyncio.run = lambda coro, **kw: run(probed(coro), **kw)  # type: ignore[assignment]


if __name__ == "__main__":
    _install(sys.argv[1])
    from kvcoord.service.cli import main

    sys.exit(main(sys.argv[2:]))
