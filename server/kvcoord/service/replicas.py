"""`kvcoord serve --replicas N`: N replica processes of one cluster on one host.

One Python process serves a few hundred engine steps per second on one core; a host's
other cores serve more pools as more replicas. The parent starts N children, each a
plain ``kvcoord serve`` of the same configuration with its own:

* listener: the configured port plus its index (port 0: each picks a free one);
* metrics listener: likewise (none when metrics are off);
* data directory: ``<data_dir>/replica-<i>`` (each keeps its own journal);
* replica id: ``<replica_id or host name>-<i>`` (stable across restarts: its journal's
  pools are claimed again);
* advertised address: the configured one's port plus its index, when one is set.

It supervises them: a child that exits is started again (after a pause that grows
while it keeps failing at once), and SIGTERM/SIGINT is passed to every child (each
hands its pools over to the others as it leaves) and waited for. The children share
the pools through the cluster store ([cluster] is required).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from .config import ENV_ADVERTISE, ENV_DATA_DIR, ENV_LISTEN, ENV_METRICS, ENV_REPLICA_ID, ServerConfig

__all__ = ["child_settings", "replica_count", "supervise"]

logger = logging.getLogger("kvcoord.lifecycle")

#: a child that ran at least this long before exiting is restarted at once
HEALTHY_SECONDS = 10.0
MAX_RESTART_PAUSE = 30.0


def replica_count(value: str, cpus: int | None = None) -> int:
    """``--replicas``: a count, or ``0``/``auto`` for one per core.

    Raises:
        ValueError: not a count.
    """
    if value.strip().lower() in ("0", "auto"):
        return max(1, cpus if cpus is not None else (os.cpu_count() or 1))
    n = int(value)
    if n < 1:
        raise ValueError(f"--replicas must be a positive count, 0 or auto, got {value!r}")
    return n


def _shifted(address: str, index: int) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        return address
    return f"{host}:{int(port) + index}"


def child_settings(cfg: ServerConfig, index: int) -> dict[str, str]:
    """The environment overrides of child ``index`` (see the module docstring)."""
    tcp = [a for a in cfg.server.listen if not a.startswith("unix:")]
    if not tcp:
        raise ValueError("--replicas needs a TCP listener (server.listen)")
    env = {
        ENV_LISTEN: _shifted(tcp[0], index),
        ENV_METRICS: _shifted(cfg.server.metrics_listen, index) if cfg.server.metrics_listen else "",
        ENV_REPLICA_ID: f"{cfg.cluster.replica_id or socket.gethostname()}-{index}",
    }
    if cfg.server.data_dir:
        env[ENV_DATA_DIR] = os.path.join(cfg.server.data_dir, f"replica-{index}")
    if cfg.cluster.advertise_address:
        env[ENV_ADVERTISE] = _shifted(cfg.cluster.advertise_address, index)
    return env


class _Child:
    def __init__(self, index: int, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.index = index
        self.argv = list(argv)
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.failures = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env)
        self.started_at = time.monotonic()
        logger.info("replica %d started (pid %d)", self.index, self.proc.pid)


def supervise(cfg: ServerConfig, count: int, argv: Sequence[str], poll: float = 0.2) -> int:
    """Run ``count`` children of ``argv`` (a ``kvcoord serve`` command line without
    ``--replicas``) until SIGTERM/SIGINT; returns 0 once every child stopped cleanly."""
    children = []
    for i in range(count):
        env = {**os.environ, **child_settings(cfg, i)}
        children.append(_Child(i, argv, env))
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    for child in children:
        child.start()
    logger.info("kvcoord supervising %d replicas", count)
    restart_at: dict[int, float] = {}
    while not stop.wait(poll):
        now = time.monotonic()
        for child in children:
            assert child.proc is not None
            code = child.proc.poll()
            if code is None:
                continue
            if child.index not in restart_at:
                ran = now - child.started_at
                child.failures = 0 if ran >= HEALTHY_SECONDS else child.failures + 1
                pause = min(MAX_RESTART_PAUSE, 0.5 * (2**child.failures)) if child.failures else 0.0
                logger.warning(
                    "replica %d exited with %d after %.1f s: restarting in %.1f s",
                    child.index,
                    code,
                    ran,
                    pause,
                )
                restart_at[child.index] = now + pause
            if now >= restart_at[child.index]:
                del restart_at[child.index]
                child.start()
    worst = 0
    for child in children:
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in children:
        if child.proc is None:
            continue
        code = child.proc.wait()
        worst = worst or code
    logger.info("kvcoord replicas stopped")
    return 0 if worst == 0 else worst


def child_argv(config_path: str | None, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one replica (the running interpreter's ``kvcoord serve``)."""
    argv = [sys.executable, "-m", "kvcoord.service.cli", "serve"]
    if config_path:
        argv += ["--config", config_path]
    return argv + list(extra)
