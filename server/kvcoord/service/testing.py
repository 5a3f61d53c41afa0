"""An in-process server on a free loopback port, for tests (runs its own event loop thread)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from .config import ServerConfig, parse_config
from .metrics import Metrics
from .registry import Limits
from .server import RunningServer, start_server

__all__ = ["InProcessServer", "ManualClock"]


class ManualClock:
    """A clock that only moves when told to (session leases without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class InProcessServer:
    """Start with :meth:`start`; ``address`` is ``127.0.0.1:<port>``.

    Args:
        config_text: TOML configuration (pools etc.); listeners are replaced by port 0.
        limits: overrides the config's limits.
        clock: session clock (a :class:`ManualClock` in tests).
        wall_clock: seconds since the epoch (pool creation times, the journal's records).
    """

    def __init__(
        self,
        config_text: str = "",
        *,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        metrics: bool = True,
        port: int = 0,
        **settings: Any,
    ) -> None:
        cfg = parse_config(config_text, "test config")
        server = dataclasses.replace(cfg.server, listen=(f"127.0.0.1:{port}",), metrics_listen="", **settings)
        self.config = ServerConfig(server, limits or cfg.limits, cfg.pools, cfg.tenants, cfg.kv_events)
        self.clock = clock
        self.wall_clock = wall_clock
        self.metrics = Metrics() if metrics else None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvcoord-test-server", daemon=True)
        self.running: RunningServer | None = None

    #: the longest a start, call, settle or stop may take: a bound on a hang, generous for
    #: a loaded machine (a journal of 65,536 requests of 16 blocks replays in ~4 s of CPU,
    #: over 30 s at load 15 on 2 cores)
    timeout = 240.0

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout or self.timeout)

    def start(self) -> InProcessServer:
        self._thread.start()
        m = self.metrics
        self.running = self._run(
            start_server(
                self.config,
                observer=m,
                interceptors=[m.interceptor()] if m else [],
                clock=self.clock,
                wall_clock=self.wall_clock,
                reap_interval=3600.0,
            )
        )
        if m is not None:
            m.bind(self.running.servicer, self.loop)
        return self

    @property
    def address(self) -> str:
        assert self.running is not None
        return self.running.addresses[0]

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's loop (e.g. to reap sessions) and return its value."""

        async def wrapper() -> Any:
            return fn()

        return self._run(wrapper())

    def settle(self) -> None:
        """Wait for what earlier calls left running on the server's loop (the sliced
        teardown of deleted pools)."""
        assert self.running is not None
        self._run(self.running.servicer.teardowns_done())

    def stop(self, grace: float = 1.0, snapshot: bool = True) -> None:
        """Stop cleanly (with a journal: a snapshot is taken unless ``snapshot`` is False)."""
        if self.loop.is_closed():
            return
        if self.running is not None:
            self._run(self.running.stop(grace, snapshot))
            self.running = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
