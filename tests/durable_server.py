"""A journaled server process on a fixed port that tests kill with SIGKILL and restart."""

from __future__ import annotations

import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, GracePeriodError, KVCoordError, SessionExpiredError
from ports import free_port
from stopping import stop_process

if TYPE_CHECKING:
    from kvcoord.v1 import allocator_pb2

ROOT = Path(__file__).resolve().parents[1]


def small_pool(num_blocks: int) -> str:
    """Server config: one pool "p" of full attention, 4-token blocks."""
    return f"""
[[pools]]
name = "p"
num_blocks = {num_blocks}
hash_block_size = 4
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
[[pools.groups]]
type = "full"
block_size = 4
"""


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = f"{ROOT / 'client'}:{ROOT / 'server'}"
    e.pop("KVCOORD_CONFIG", None)
    return e


def with_sitecustomize(tmp: Path, source: str, monkeypatch: Any) -> None:
    """Servers started from now on (this test) import ``source`` as their
    ``sitecustomize`` (a hook that holds or breaks the server at a chosen point)."""
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(source)
    e = env()
    e["PYTHONPATH"] = f"{hook}:{e['PYTHONPATH']}"
    monkeypatch.setattr(sys.modules[__name__], "env", lambda: e)


class DurableServer:
    """``kvcoord serve`` with a data directory; :meth:`kill` is SIGKILL, :meth:`start`
    (re)starts it on the same port and waits until it answers health checks."""

    def __init__(
        self, tmp: Path, pools_toml: str = "", synchronous: str = "NORMAL", snapshot_every: int = 2000
    ) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.data_dir = tmp / "data"
        self.config = tmp / "kvcoord.toml"
        self.config.write_text(
            f'[server]\nlisten = ["{self.address}"]\nmetrics_listen = ""\n'
            f'data_dir = "{self.data_dir}"\nsynchronous = "{synchronous}"\nsnapshot_every = {snapshot_every}\n'
            f'log_level = "WARNING"\n{pools_toml}'
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.starts = 0
        self.kills = 0
        self.start_seconds = 0.0  # how long the last start took to answer health
        self.lock = threading.Lock()

    def start(
        self, timeout: float = 180.0, max_file_bytes: int | None = None, args: tuple[str, ...] = ()
    ) -> None:
        """``timeout``: a bound on a hang, generous (a start took 20-35 s at load 25-30 on
        2 cores, 1-2 s idle). ``max_file_bytes``: no file the server writes may grow past this (RLIMIT_FSIZE;
        Python ignores SIGXFSZ, so the write fails with EFBIG, as on a full disk). Set
        with prlimit once the process runs: a ``preexec_fn`` would make subprocess fork
        instead of vfork, and gRPC's fork handlers in this process can then abort the
        child before it execs."""
        self._log = open(self.tmp / f"server-{self.starts}.log", "wb")  # noqa: SIM115 - closed on kill/stop
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(self.config), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env(),
        )  # fmt: skip
        if max_file_bytes is not None:
            resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
        self.starts += 1
        began = time.monotonic()
        deadline = began + timeout
        with KVCoordClient(self.address, timeout=1.0) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
                # Health is asked once the port takes connections: a health call before
                # that fails and puts the channel in gRPC's reconnect backoff, which then
                # saw a server that came up 0.1-0.4 s late (at every restart of a test)
                try:
                    if _accepts(self.port) and c.health() == "SERVING":
                        self.start_seconds = time.monotonic() - began
                        return
                except KVCoordError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(self.log())
                time.sleep(0.01)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()
        self.kills += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The server and every process it forked (a snapshot child writes and renames its
        file on its own) held with SIGSTOP, as an atomic volume snapshot sees them: the
        parent first, so it forks no more, then its children, each waited for until none
        of its threads runs (:func:`stop_process`: a bare SIGSTOP only starts the stop,
        and the server's other threads may write on for a while after it)."""
        assert self.proc is not None
        stop_process(self.proc.pid)
        held = [self.proc.pid]
        try:
            for pid in _descendants(self.proc.pid):
                try:
                    stop_process(pid)
                    held.append(pid)
                except ProcessLookupError:  # it exited meanwhile
                    pass
            yield
        finally:
            for pid in reversed(held):
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def restart(self) -> None:
        with self.lock:
            self.kill()
            self.start()

    def log(self) -> str:
        return (self.tmp / f"server-{self.starts - 1}.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()


def stall_bound_lines(lease: float) -> str:
    """The ``journal_stall_seconds`` line a durable server whose default lease is
    ``lease`` needs: none when the lease outlasts the 10 s default bound, else the largest
    bound it outlasts (the config refuses one it does not: stalls.py), rounded down to
    0.05 s."""
    from kvcoord.service.config import DEFAULT_STALL_SECONDS
    from kvcoord.service.stalls import lease_outlasts_stalls, max_bound_seconds

    if lease_outlasts_stalls(lease, DEFAULT_STALL_SECONDS):
        return ""
    return f"journal_stall_seconds = {math.floor((max_bound_seconds(lease) - 0.01) * 20) / 20}\n"


def leased_server(tmp: Path, lease: float, num_blocks: int, stall: float | None = None) -> DurableServer:
    """A :class:`DurableServer` of one pool ``p`` whose sessions' leases are ``lease``
    seconds (the longest a client may ask for too) and whose answers are kept 4 leases;
    ``stall``: its journal_stall_seconds (None: a short lease gets the bound it
    outlasts, :func:`stall_bound_lines`)."""
    bound = stall_bound_lines(lease) if stall is None else f"journal_stall_seconds = {stall}\n"
    server = DurableServer(tmp, small_pool(num_blocks))
    server.config.write_text(
        server.config.read_text().replace(
            "snapshot_every = 2000\n",
            f"snapshot_every = 2000\nmax_session_lease_seconds = {lease}\nsession_lease_seconds = {lease}\n"
            f"idempotency_window_seconds = {4 * lease}\n{bound}",
        )
    )
    return server


def started_for_grace(tmp: Path, lease: float, num_blocks: int, starts: int) -> tuple[DurableServer, float]:
    """A started :func:`leased_server` whose lease, and so the grace a restore or a lost
    journal begins, outlasts ``starts`` more starts of it, each answering a probe: the
    lease asked for, or twice the time those starts take at the speed of the first one
    where that is longer. A grace must still be running when a restarted process
    answers, and on a loaded machine a start took 20-35 s (load 25-30 on 2 cores;
    1-2 s idle): a 5 s grace had ended before the first probe (a slow start, not a short
    grace). A slow first start is stopped and made again, on a new data directory, with
    the longer lease. Returns the server and its lease."""
    server = leased_server(tmp, lease, num_blocks)
    server.start()
    needed = math.ceil(2 * starts * server.start_seconds)
    if needed <= lease:
        return server, lease
    server.stop()
    shutil.rmtree(server.data_dir)
    server = leased_server(tmp, needed, num_blocks)
    server.start()
    return server, float(needed)


def step_allocate(c: KVCoordClient, session: Any, rid: str, num_tokens: int) -> list[int]:
    """Register ``rid`` with ``num_tokens`` tokens (a block hash per 4) in pool ``p`` and
    allocate them in one Step: the new block ids (the Step must succeed)."""
    from kvcoord.v1 import allocator_pb2 as pb

    sync = pb.RequestSync(
        request_id=rid, append_token_ids=list(range(num_tokens)), new_request=True,
        append_block_hashes=[f"{rid}-{i}".encode().ljust(32, b".") for i in range(num_tokens // 4)],
    )  # fmt: skip
    op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=num_tokens))
    result = c.step("p", [op], session.session_id, session.fence).results[0]
    assert result.status_code == 0, result
    return list(result.allocate.new_block_ids[0].block_ids)


def one_block_step(session: Any, i: int) -> allocator_pb2.StepRequest:
    """A keyed Step (idempotency key ``k<i>``) of pool ``p`` that registers request
    ``r<i>`` with 4 tokens and one block hash and allocates its one block."""
    from kvcoord.v1 import allocator_pb2 as pb

    rid = f"r{i}"
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=[1, 2, 3, 4], new_request=True,
        append_block_hashes=[rid.encode().ljust(32, b".")],
    )  # fmt: skip
    op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=4))
    return pb.StepRequest(
        pool="p", session_id=session.session_id, fence=session.fence, ops=[op], idempotency_key=f"k{i}"
    )


def assert_not_serving(c: KVCoordClient) -> None:
    """The server has stopped serving: its health is no longer SERVING, or it is gone."""
    try:
        health = c.health()
    except KVCoordError:
        health = "gone"
    assert health != "SERVING"


def held_first_group(c: KVCoordClient) -> dict[str, list[int]]:
    """Every request pool ``p`` holds: its first group's block ids, by request id."""
    return {
        r.request_id: list(r.groups[0].block_ids) for r in c.inspect_pool("p", all_requests=True).requests
    }


@contextmanager
def restarted_holding(
    server: DurableServer, acked: dict[str, list[int]], *in_log: str
) -> Iterator[KVCoordClient]:
    """The tail of a test that stopped the server (a stall, a failed write): its last
    log names each of ``in_log``; started again, it holds every acknowledged allocation
    (``acked``: request id -> first group's block ids). Yields a client of the restarted
    server, stopped after."""
    log = server.log()
    assert all(s in log for s in in_log), log
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            held = held_first_group(c)
            assert {rid: held.get(rid) for rid in acked} == acked
            yield c
    finally:
        server.stop()


def attach(c: KVCoordClient, name: str, lease: float) -> Any:
    """Worker ``name``'s session on pool ``p`` (the pools of :func:`small_pool`)."""
    return c.attach("p", "sha256_cbor", 4, "0", name, lease_seconds=lease)


def copy_volume(server: DurableServer, copy: Path) -> None:
    """A volume snapshot: ``cp -a`` of the server's data directory to ``copy``."""
    subprocess.run(["cp", "-a", str(server.data_dir), str(copy)], check=True)


def restore_volume(server: DurableServer, copy: Path) -> None:
    """SIGKILL the server and put ``copy`` (a :func:`copy_volume`) in place of the data
    directory, as restoring a volume snapshot does."""
    server.kill()
    shutil.rmtree(server.data_dir)
    subprocess.run(["cp", "-a", str(copy), str(server.data_dir)], check=True)


def two_workers_then_copy(server: DurableServer, lease: float, copy: Path) -> tuple[Any, Any]:
    """Workers a and b attach and allocate a1 and b1 (8 tokens each), then the volume is
    copied to ``copy``: their sessions, as the copy holds them."""
    with KVCoordClient(server.address) as c:
        a = attach(c, "worker-a", lease)
        b = attach(c, "worker-b", lease)
        step_allocate(c, a, "a1", 8)
        step_allocate(c, b, "b1", 8)
        copy_volume(server, copy)
    return a, b


def workers_told_more_than_the_copy(
    server: DurableServer, lease: float, copy: Path
) -> tuple[Any, Any, list[int]]:
    """:func:`two_workers_then_copy`, then worker a keeps working: a Step tells it the
    journal's position (its fence adopted: a position the copy lacks) and it allocates a2
    (32 tokens). Returns a, b and a2's blocks."""
    a, b = two_workers_then_copy(server, lease, copy)
    with KVCoordClient(server.address) as c:
        step = c.step("p", [], a.session_id, a.fence)
        a.fence.CopyFrom(step.fence)
        told = step_allocate(c, a, "a2", 32)
    assert a.fence.position > 0
    return a, b, told


def assert_handed_none_of(
    c: KVCoordClient, session: Any, held: list[int], rid: str = "b2", tokens: int = 48
) -> None:
    """``session`` allocates ``rid`` (``tokens``; refused SessionExpiredError or FencedError is
    as good): none of ``held``, the blocks a live worker holds, is handed to it."""
    given: list[int] = []
    try:
        given = step_allocate(c, session, rid, tokens)
    except (SessionExpiredError, FencedError):
        pass
    assert not set(given) & set(held), f"blocks {sorted(set(given) & set(held))} handed out twice"


def serve_once(config: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvcoord serve --config config *args`` run to its exit (a start that must be refused),
    its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(config), *args],
        capture_output=True, text=True, env=env(), timeout=timeout,
    )  # fmt: skip


def refused_for_grace(address: str, lease: float) -> bool:
    """A probe's Attach to pool ``p`` is refused for the grace period (GracePeriodError)."""
    with KVCoordClient(address, retry=NO_RETRY) as c:
        try:
            c.attach("p", "sha256_cbor", 4, "0", "probe", lease_seconds=lease)
        except GracePeriodError:
            return True
    return False


def attach_after_grace(
    target: KVCoordClient | str, lease: float, name: str, limit: float, poll: float = 0.05
) -> tuple[Any, float]:
    """Attach worker ``name`` once the server's grace has ended (``target``: a client
    without retries, or an address to open one on), asserting it ends within ``limit``
    seconds: the session and when it attached."""
    if isinstance(target, str):
        with KVCoordClient(target, retry=NO_RETRY) as c:
            return attach_after_grace(c, lease, name, limit, poll)
    deadline = time.monotonic() + limit
    while True:
        try:
            return attach(target, name, lease), time.monotonic()
        except GracePeriodError:
            assert time.monotonic() < deadline, "the grace never ended"
            time.sleep(poll)


def assert_restore_proven(c: KVCoordClient, a: Any, b: Any, lease: float) -> None:
    """Worker a, told more than the restored copy holds, calls: its Step proves the
    restore (FencedError); worker b's session, of the copy, ended with it; no session
    attaches inside the grace; no request is held and nothing is cached."""
    with pytest.raises(FencedError):
        step_allocate(c, a, "a3", 4)
    with pytest.raises((SessionExpiredError, FencedError)):
        c.heartbeat(b.session_id, b.fence)
    with pytest.raises(GracePeriodError):
        attach(c, "worker-c", lease)
    inspected = c.inspect_pool("p", all_requests=True, include_cached_blocks=True)
    assert not inspected.requests and not inspected.cached_block_ids


def prove_restore_then_attach(server: DurableServer, copy: Path, prover: Any, rid: str, lease: float) -> Any:
    """Put ``copy`` back (:func:`restore_volume`) and start the server on it; worker
    ``prover``, told more than the copy holds, allocates ``rid``: refused, its fence
    proves the restore (FencedError); then worker d attaches once the grace has ended
    (within 6 leases): its session."""
    restore_volume(server, copy)
    server.start()
    with KVCoordClient(server.address, retry=NO_RETRY) as c:
        with pytest.raises(FencedError):
            step_allocate(c, prover, rid, 4)  # the proof
    d, _ = attach_after_grace(server.address, lease, "worker-d", 6 * lease)
    return d


def _accepts(port: int) -> bool:
    """True when something takes TCP connections on ``port`` of the loopback."""
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux's /proc/<pid>/task/<tid>/children)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the task ended meanwhile
                continue
            for child in map(int, children):
                if child not in found:
                    found.append(child)
                    todo.append(child)
    return found
