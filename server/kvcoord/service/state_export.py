"""A large pool's state encoded off the event loop, as it was at one moment.

An exclusive ``Attach`` with ``want_engine_state`` answers the engine's whole state
(:meth:`~kvcoord.service.pool_service.PoolService.mirror_state`: ``export_state`` as
CBOR), a pass over every block and request of the pool. On the event loop that pass
stalls every other pool's calls for as long as it takes, which grows with the pool.

For a pool that has built at least :data:`FORK_BLOCKS` blocks the state is taken
the way journal snapshots are (durability.py): the process forks, and the child, which
holds a copy-on-write image of the pool exactly as it is at that moment (the Attach's
position: calls the loop answers afterwards change only the parent's pool), encodes it
into a pipe and exits. A thread reads the pipe while the loop goes on answering other
calls; the loop stands still only for the fork. Smaller pools, and a process in which
forking is unsafe (gRPC's fork handlers on, see ``kvcoord/service/__init__.py``), are
encoded on the loop as before, and so is a state whose fork is refused (EAGAIN under a
pids limit, ENOMEM): the call that made it due has been applied, and must be answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import cbor2

from .durability import leave_parent

if TYPE_CHECKING:  # pragma: no cover
    from .pool_service import MirrorState, PoolService

__all__ = [
    "FORK_BLOCKS",
    "ExportError",
    "apart",
    "collect",
    "encode_started",
    "encoded_apart",
    "fork_encoder",
    "mirror_state_apart",
    "pool_encoded",
    "started_apart",
]

logger = logging.getLogger(__name__)

#: blocks a pool has built (handed out at least once) from which its state is encoded in a forked child
#: (below it the pass on the loop takes about as long as the fork)
FORK_BLOCKS = 32768


class ExportError(Exception):
    """The child encoding a state failed (its traceback is on the server's stderr)."""


def _forkable() -> bool:
    from . import FORK_SAFE

    return FORK_SAFE and hasattr(os, "fork") and sys.platform != "win32"


class _Child:
    """A forked child and whether it was reaped: it is killed only before (its pid may
    belong to another process after)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reaped = False
        self.lock = threading.Lock()

    def kill(self) -> None:
        with self.lock:
            if not self.reaped:
                os.kill(self.pid, signal.SIGKILL)

    def collect(self, fd: int) -> tuple[bytes, int]:
        """Read the pipe to its end, wait for the child's exit, reap it (on a thread)."""
        chunks = []
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
            with self.lock:
                _, status = os.waitpid(self.pid, 0)
                self.reaped = True
        return b"".join(chunks), status


def fork_encoder(encode: Callable[[], bytes]) -> tuple[int, int]:
    """Fork a child that writes ``encode()`` of the state as it is now into a pipe and
    exits; returns its pid and the pipe's reading end (see :func:`collect`)."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    try:
        pid = os.fork()
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # the child: no event loop, no gRPC; only this
        code = 1
        try:
            os.close(read_fd)
            leave_parent(parent, keep=write_fd)
            view = memoryview(encode())
            while view:
                view = view[os.write(write_fd, view) :]
            code = 0
        except BaseException:
            with contextlib.suppress(BaseException):
                os.write(2, f"kvcoord state export child failed:\n{traceback.format_exc()}".encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    return pid, read_fd


async def collect(pid: int, read_fd: int) -> bytes:
    """What the child of :func:`fork_encoder` wrote, read on a thread while the loop
    goes on; the caller's cancellation kills the child.

    Raises:
        ExportError: the child failed or was killed.
    """
    child = _Child(pid)
    reading = asyncio.get_running_loop().run_in_executor(None, child.collect, read_fd)
    try:
        data, status = await asyncio.shield(reading)
    except BaseException:
        # the reader thread then sees the pipe's end, closes it and reaps the child
        child.kill()
        raise
    if status != 0:
        raise ExportError(f"the child encoding the state ended with wait status {status}")
    return data


def _forked(encode: Callable[[], bytes]) -> tuple[int, int] | None:
    """:func:`fork_encoder`, or None when the process cannot fork (an OSError: a pids
    limit, memory); the caller then encodes on the loop."""
    try:
        return fork_encoder(encode)
    except OSError as exc:
        logger.warning("cannot fork to encode a pool's state off the loop (%s): encoded on the loop", exc)
        return None


def started_apart(encode: Callable[[], bytes]) -> tuple[int, int] | None:
    """:func:`fork_encoder` of ``encode`` when this process may fork (see the module
    docstring; then :func:`collect` its bytes); None when it may not or the fork fails
    (the caller encodes elsewhere)."""
    return _forked(encode) if _forkable() else None


def encode_started(encode: Callable[[], bytes]) -> bytes | asyncio.Future[bytes]:
    """``encode()`` of the state as it is now, started in a forked child (a future of
    its bytes: see :func:`collect`), or its bytes encoded here when forking fails."""
    forked = _forked(encode)
    return encode() if forked is None else asyncio.ensure_future(collect(*forked))


async def encoded_apart(encode: Callable[[], bytes]) -> bytes:
    """``encode()`` run in a forked child on the state as it is now; the loop goes on
    meanwhile (see :func:`collect`). Encoded here when forking fails."""
    forked = _forked(encode)
    return encode() if forked is None else await collect(*forked)


def apart(service: PoolService) -> bool:
    """Whether ``service``'s state is encoded in a forked child (see the module docstring)."""
    return service.num_materialised_blocks >= FORK_BLOCKS and _forkable()


async def pool_encoded(service: PoolService, encode: Callable[[], bytes]) -> bytes:
    """``encode()`` of ``service``'s state as it is now: in a forked child for a large
    pool, else here."""
    return await encoded_apart(encode) if apart(service) else encode()


async def mirror_state_apart(service: PoolService, cache_namespace: str) -> MirrorState | str:
    """:meth:`PoolService.mirror_state` as it is now; encoded in a forked child for a
    large pool (see the module docstring).

    Raises:
        ExportError: the child failed.
    """
    if not apart(service):
        return service.mirror_state(cache_namespace)

    def encode() -> bytes:
        state = service.mirror_state(cache_namespace)
        if isinstance(state, str):
            return cbor2.dumps(state)
        return cbor2.dumps([state.engine_state, state.version, state.rules, state.cache_namespace])

    from .pool_service import MirrorState

    value = cbor2.loads(await encoded_apart(encode))
    return value if isinstance(value, str) else MirrorState(*value)
