"""Test helpers for users of the client: a real kvcoord server in a subprocess.

It starts ``python -m kvcoord.service.cli serve`` (the installed server), so importing
this module needs nothing from the server side::

    from kvcoord.client.testing import running_server

    with running_server() as address:
        client = KVCoordClient(address)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import IO

__all__ = ["ServerProcess", "running_server"]

_READY = re.compile(r"kvcoord serving gRPC on (\S+?)[;,]")
_METRICS = re.compile(r"kvcoord metrics on https?://(\S+)/metrics")


@dataclasses.dataclass(eq=False)
class ServerProcess:
    """A started server process and the addresses it printed."""

    proc: subprocess.Popen[str]
    address: str
    metrics_address: str | None
    log_path: str
    _log_file: IO[str] = dataclasses.field(repr=False)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8") as f:
            return f.read()

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log_file.close()
        return self.proc.returncode


def start_server(
    config_text: str | None = None,
    *,
    metrics: bool = False,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    startup_timeout: float = 30.0,
    launcher: Sequence[str] = (),
) -> ServerProcess:
    """Start a server on 127.0.0.1 with a free port; ``config_text`` is a TOML config.

    Unless ``env`` or the config names a data directory, the server's (a journaled
    server always has one) is a fresh temporary directory, never the user's default.
    ``launcher``: the command given ``serve`` and its arguments (default ``python -m
    kvcoord.service.cli``; bench/stall.py's wraps the server in a probe).
    """
    tmp = tempfile.mkdtemp(prefix="kvcoord-test-")
    env = dict(os.environ if env is None else env)
    if "data_dir" not in (config_text or ""):
        env.setdefault("KVCOORD_DATA_DIR", os.path.join(tmp, "data"))
    args = [*(launcher or (sys.executable, "-m", "kvcoord.service.cli")), "serve", "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0" if metrics else ""]  # fmt: skip
    if config_text is not None:
        path = os.path.join(tmp, "config.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(config_text)
        args += ["--config", path]
    args += list(extra_args)
    log_path = os.path.join(tmp, "server.log")
    log = open(log_path, "w+", encoding="utf-8")  # noqa: SIM115 - owned by the ServerProcess
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            with open(log_path, encoding="utf-8") as f:
                text = f.read()
            m = _READY.search(text)
            mm = _METRICS.search(text)
            if m and (not metrics or mm):
                return ServerProcess(proc, m.group(1), mm.group(1) if mm else None, log_path, log)
            if proc.poll() is not None:
                raise RuntimeError(f"kvcoord server exited with {proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise TimeoutError(f"kvcoord server did not start within {startup_timeout}s")
    except BaseException:
        # never leave a server behind when startup fails
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        raise


@contextlib.contextmanager
def running_server(config_text: str | None = None, **kwargs: object) -> Iterator[str]:
    """A server for the duration of the block; yields its ``host:port``."""
    server = start_server(config_text, **kwargs)  # type: ignore[arg-type]
    try:
        yield server.address
    finally:
        server.stop()
