"""A real etcd for the cluster tests: loopback, a temporary data directory, free ports,
bounded waits. Without the binary the tests fail (never skip), naming how to install it."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aetcd
import cbor2
import pytest
from kvcoord.service.errors import ServiceError, Status
from kvcoord.service.store_journal import PoolStreams
from ports import free_ports
from stopping import stop_process
from tcp_proxy import Proxy

#: starts tried, each on fresh ports, when a port was taken before etcd bound it
STARTS = 3


class PortTaken(RuntimeError):
    """etcd could not bind a port it was given (taken meanwhile): started again elsewhere."""


def _start_over(start: Callable[[Path], None], stop: Callable[[], None], tmp: Path) -> None:
    """``start(tmp / "start<n>")``; stopped and started again, on fresh ports, when a
    port was taken (:class:`PortTaken`), at most :data:`STARTS` times."""
    for attempt in range(STARTS):
        try:
            start(tmp / f"start{attempt}")
            return
        except PortTaken:
            stop()
            if attempt == STARTS - 1:
                raise


def _exited(log: Path, what: str, code: int | None) -> RuntimeError:
    text = log.read_text(errors="replace")
    error = PortTaken if "address already in use" in text else RuntimeError
    return error(f"{what} exited with {code}: {text[-2000:]}")


def etcd_binary() -> str:
    """The etcd binary; a test that needs it fails without it (``make install`` installs
    Debian's etcd-server), so that a run without etcd never reads as passing."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.fail("etcd is not installed (apt-get install etcd-server; make install does)")
    return binary


class Etcd:
    """One etcd member on 127.0.0.1; :attr:`endpoint` is its client host:port.
    ``args``: more of etcd's flags (``--quota-backend-bytes``, ...)."""

    def __init__(self, tmp: Path, args: tuple[str, ...] = ()) -> None:
        _start_over(lambda where: self._start(where, args), self.stop, tmp)

    def _start(self, tmp: Path, args: tuple[str, ...]) -> None:
        binary = etcd_binary()
        tmp.mkdir(parents=True)
        self.port, peer = free_ports(2)
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log_path = tmp / "etcd.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        data = tempfile.mkdtemp(prefix="etcd-", dir=tmp)
        self.proc = subprocess.Popen(
            [binary, "--name", "t", "--data-dir", data,
             "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "warn", *args],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._wait_ready(30.0)

    def _wait_ready(self, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.flush()
                raise _exited(self.log_path, "etcd", self.proc.returncode)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"etcd did not listen within {timeout} s")

    def freeze(self) -> None:
        """SIGSTOP etcd and return once it is stopped (:func:`stop_process`): its sockets
        stay open (the kernel still accepts and acknowledges), nothing is answered."""
        assert self.proc.poll() is None
        stop_process(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class EtcdCluster:
    """Three etcd members on 127.0.0.1 (a real Raft quorum: one member may die).
    :meth:`kill` SIGKILLs a member, :meth:`restart` starts it again on its data.
    With ``peer_proxies`` each member's peer URL is a :class:`~tcp_proxy.Proxy` to it:
    :meth:`isolate` cuts one member off from the others (a minority partition; its
    client port still answers), :meth:`rejoin` heals it."""

    def __init__(self, tmp: Path, size: int = 3, peer_proxies: bool = False) -> None:
        self.proxies: list[Proxy] = []
        _start_over(lambda where: self._start_all(where, size, peer_proxies), self.stop, tmp)

    def _start_all(self, tmp: Path, size: int, peer_proxies: bool) -> None:
        binary = etcd_binary()
        tmp.mkdir(parents=True)
        self.binary = binary
        self.tmp = tmp
        self.names = [f"e{i}" for i in range(size)]
        ports = free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.endpoints = [f"127.0.0.1:{p}" for p in self.client_ports]
        if peer_proxies:
            self.proxies = [Proxy(f"127.0.0.1:{p}") for p in self.peer_ports]
        #: the peer URL each member advertises (its proxy's, with peer_proxies)
        self.peer_urls = [
            f"http://{self.proxies[i].address}" if self.proxies else f"http://127.0.0.1:{p}"
            for i, p in enumerate(self.peer_ports)
        ]
        self.initial = ",".join(f"{n}={u}" for n, u in zip(self.names, self.peer_urls, strict=True))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self._logs = [open(tmp / f"{n}.log", "ab") for n in self.names]  # noqa: SIM115 - closed in stop()
        for i in range(size):
            self._start(i)
        for i in range(size):
            self._wait_ready(i, 30.0)
        self.wait_quorum(30.0)

    def wait_quorum(self, timeout: float) -> None:
        """Until a write through the members commits (a leader is elected)."""
        import asyncio

        import aetcd

        async def put() -> None:
            target = "ipv4:" + ",".join(self.endpoints)
            host, _, port = target.rpartition(":")
            async with aetcd.Client(host=host, port=int(port), timeout=1) as c:
                await c.put(b"/ready", b"1")

        deadline = time.monotonic() + timeout
        while True:
            try:
                asyncio.run(put())
                return
            except Exception:  # noqa: BLE001 - no leader yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _start(self, i: int) -> None:
        name, peer, client = self.names[i], self.peer_ports[i], self.client_ports[i]
        self.procs[i] = subprocess.Popen(
            [self.binary, "--name", name, "--data-dir", str(self.tmp / f"{name}.data"),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", self.peer_urls[i],
             "--initial-cluster", self.initial, "--initial-cluster-state", "new",
             "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"],
            stdout=self._logs[i], stderr=subprocess.STDOUT,
        )  # fmt: skip

    def _wait_ready(self, i: int, timeout: float) -> None:
        import socket

        proc = self.procs[i]
        assert proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._logs[i].flush()
                raise _exited(self.tmp / f"{self.names[i]}.log", f"etcd {self.names[i]}", proc.returncode)
            try:
                with socket.create_connection(("127.0.0.1", self.client_ports[i]), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"etcd {self.names[i]} did not listen within {timeout} s")

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def freeze(self, i: int) -> None:
        """SIGSTOP member ``i`` and return once it is stopped (:func:`stop_process`): its
        sockets stay open (the kernel still accepts and acknowledges), nothing is answered."""
        proc = self.procs[i]
        assert proc is not None and proc.poll() is None
        stop_process(proc.pid)

    def thaw(self, i: int) -> None:
        """SIGCONT member ``i``; returns once it answers a linearizable read."""
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGCONT)
        self.wait_serving(i, 30.0)

    def isolate(self, i: int) -> None:
        """Cut member ``i``'s peer links, both ways (peer_proxies): it keeps running
        and answering its clients, without a leader and unable to commit; the others
        keep the quorum."""
        proc = self.procs[i]
        assert self.proxies and proc is not None and proc.poll() is None
        self.proxies[i].cut()
        for j, proxy in enumerate(self.proxies):
            if j != i:
                proxy.cut_from(proc.pid)

    def lead(self, i: int, timeout: float = 30.0) -> None:
        """Until member ``i`` is the leader (etcd's MoveLeader, asked of the leader;
        a bound, then the error)."""
        import asyncio

        import aetcd
        from aetcd import rpc

        async def move() -> bool:
            status = {}
            for j, port in enumerate(self.client_ports):
                async with aetcd.Client(host="127.0.0.1", port=port, timeout=2) as c:
                    status[j] = await c.maintenancestub.Status(rpc.StatusRequest(), timeout=2)
            leader = next(j for j, s in status.items() if s.header.member_id == s.leader)
            if leader == i:
                return True
            async with aetcd.Client(host="127.0.0.1", port=self.client_ports[leader], timeout=5) as c:
                target = status[i].header.member_id
                await c.maintenancestub.MoveLeader(rpc.MoveLeaderRequest(targetID=target), timeout=5)
            return False

        deadline = time.monotonic() + timeout
        while True:
            try:
                if asyncio.run(move()):
                    return
            except Exception:  # noqa: BLE001 - no leader yet, or it changed meanwhile
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd {self.names[i]} did not become the leader within {timeout} s")
            time.sleep(0.2)

    def rejoin(self, i: int) -> None:
        """Heal what :meth:`isolate` cut; returns once member ``i`` answers a
        linearizable read again."""
        for proxy in self.proxies:
            proxy.heal()
        self.wait_serving(i, 30.0)

    def restart(self, i: int) -> None:
        """SIGKILL member ``i`` and start it again on its data; returns once it answers
        a linearizable read (it caught up with a leader: a read through it right after
        used to time out at load 8, a test's failure 1 run in 20)."""
        self.kill(i)
        self._start(i)
        self._wait_ready(i, 30.0)
        self.wait_serving(i, 30.0)

    def wait_serving(self, i: int, timeout: float) -> None:
        """Until member ``i`` answers a linearizable read (a bound, then the error)."""
        import asyncio

        import aetcd

        async def read() -> None:
            async with aetcd.Client(host="127.0.0.1", port=self.client_ports[i], timeout=2) as c:
                await c.get(b"/ready")

        deadline = time.monotonic() + timeout
        while True:
            try:
                asyncio.run(read())
                return
            except Exception:  # noqa: BLE001 - no leader yet, or catching up
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for log in self._logs:
            log.close()
        for proxy in self.proxies:
            proxy.close()
        self.proxies = []


def store_client(etcd: Etcd) -> aetcd.Client:
    """An asyncio etcd client of ``etcd`` (the one the server's store uses)."""
    host, _, port = etcd.endpoint.rpartition(":")
    return aetcd.Client(host=host, port=int(port), timeout=5)


async def put_claim(c: aetcd.Client, key: bytes) -> int:
    """Write an ownership claim of replica r0 at ``key``; its revision (a journal's term)."""
    put = await c.put(key, b'{"replica": "r0", "address": "x"}')
    return int(put.header.revision)


@asynccontextmanager
async def pool_streams(
    etcd: Etcd, request: pytest.FixtureRequest, snapshot_every: int = 1 << 20
) -> AsyncIterator[tuple[aetcd.Client, PoolStreams]]:
    """A client of ``etcd`` and the store journal's pool streams over it, under a key
    prefix of the test's own (its name), always writable (no lease to lose); a base
    every ``snapshot_every`` records (by default never, in a test's few)."""
    prefix = f"/kvcoord/{request.node.name[:40]}/".encode()
    async with store_client(etcd) as c:
        yield c, PoolStreams(lambda: c, prefix, lambda: True, snapshot_every=snapshot_every)


async def old_term_deposed(c: aetcd.Client, streams: PoolStreams) -> tuple[int, int, list[str]]:
    """Pool p's stream opened and its base written at a term, then p claimed again (a new
    term: the old one deposed, its writes fail): (old term, new term, the pools given up
    from now on)."""
    lost: list[str] = []
    streams.on_lost = lost.append
    old = await put_claim(c, streams.owner_key("p"))
    streams.open("p", old, cbor2.dumps([0, ["base", 0.0, b"old"]]))
    await streams.flush()
    return old, await put_claim(c, streams.owner_key("p")), lost


async def old_term_call(streams: PoolStreams) -> None:
    """A call of pool p at the term its stream has now (the old one, once
    :func:`old_term_deposed` claimed p again): its record queued, then flushed. Run it
    as a task of its own (its own context, as a gRPC call's handler) and let it queue
    (``await asyncio.sleep(0)``) before the stream opens at the new term."""
    streams.append("p", cbor2.dumps([1, ["call", 0.0, "old"]]))
    await streams.flush()


async def flush_outcome(call: asyncio.Task[None]) -> str:
    """What a call that flushes the store journal was told: "told durable", or
    "UNAVAILABLE" (any other error fails the test)."""
    try:
        await call
    except ServiceError as exc:
        assert exc.status == Status.UNAVAILABLE, exc
        return "UNAVAILABLE"
    return "told durable"
