"""Helpers the step benchmarks share (imported from the scripts' own directory)."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]


def freeze_heap() -> None:
    """What vLLM's engine core does once built (freeze_gc_heap): the objects alive now
    (vLLM, torch, the scheduler or pool) leave the collector's view, so a full
    collection does not walk them every few hundred steps (with vLLM imported, one
    stalls 100-300 ms).

    Each call starts from the state vLLM's engine core starts in, whichever row came
    before: the objects an earlier call froze are thawed first, so the collection here
    counts the whole heap. CPython starts a full collection once the objects promoted
    since the last one exceed a quarter of what that one left alive; after a collection
    over a heap already frozen, that figure is only what the previous rows left, and
    every row after a bench's first paid a full collection every few dozen steps that
    the engine core (one freeze over torch and vLLM) does not."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (seconds), in milliseconds."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid`` (Linux), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def serve(config: Path, sources: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """A ``kvcoord serve --config config`` process running the checkout ``sources``
    (its ``client`` and ``server``), its output into ``log``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sources / "client"), str(sources / "server")]))
    env.pop("KVCOORD_CONFIG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


def wait_serving(address: str, seconds: float = 60.0) -> None:
    """Return once the server at ``address`` answers health checks with SERVING.

    Raises:
        TimeoutError: it did not within ``seconds``.
    """
    from kvcoord.client import KVCoordClient
    from kvcoord.client.errors import KVCoordError

    deadline = time.monotonic() + seconds
    with KVCoordClient(address, timeout=2) as c:
        while time.monotonic() < deadline:
            try:
                if c.health() == "SERVING":
                    return
            except KVCoordError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"no server answered at {address} within {seconds:g} s")


def old_tree(rev: str) -> Path:
    """The client and server sources of git revision ``rev``, in a temporary directory."""
    out = Path(tempfile.mkdtemp(prefix="kvcoord-old-"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "client", "server"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


# the servicer's handler chain called without gRPC (step_overhead.py, decode_instructions.py)


class StubContext:
    """What the guard and the metrics wrapper read of a call's context (no credentials)."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("user-agent", "bench"),)

    def auth_context(self) -> dict[str, Any]:
        return {}

    def code(self) -> None:
        return None

    async def abort(self, code: Any, message: str, trailers: Any = ()) -> None:
        raise RuntimeError(f"{code}: {message}")


class Registrar:
    """Takes the generic handler ``add_servicer`` registers."""

    handler: Any = None

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.handler = handlers[0]


class CallDetails:
    """What an interceptor is told of a call (grpc.HandlerCallDetails)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()
