"""A TCP proxy on loopback that a test can cut (every connection closed, new ones
refused at once) and heal: a partition between one process and another; or deafen
(what the target answers is dropped, what it is sent still reaches it): a request
that is carried out while its answer is lost. :meth:`Proxy.cut_from` cuts only the
connections one process makes (its peer links, the others' kept): a member of a
cluster isolated from the others, each of whose peer URLs is a proxy."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path


class Proxy:
    """Forwards 127.0.0.1:<port> to ``target`` (host:port) until :meth:`close`."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.cut_off = threading.Event()
        self.closed = threading.Event()
        self.deaf = threading.Event()
        #: processes whose connections are cut (cut_from), until heal
        self.cut_pids: set[int] = set()
        #: connections accepted and forwarded so far
        self.accepted = 0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        #: the accepted connection of each pair of sockets it forwards
        self._accepted: dict[socket.socket, socket.socket] = {}
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Close every connection; refuse new ones until :meth:`heal`."""
        self.cut_off.set()
        self._close_all()

    def cut_from(self, pid: int) -> None:
        """Close every connection process ``pid`` made to the proxy and refuse its new
        ones until :meth:`heal`; other processes' connections pass."""
        self.cut_pids.add(pid)
        with self._lock:
            pairs = list(self._accepted.items())
        for client, upstream in pairs:
            if self._from_cut_pid(client):
                for s in (client, upstream):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

    def heal(self) -> None:
        self.cut_off.clear()
        self.cut_pids.clear()

    def _from_cut_pid(self, client: socket.socket) -> bool:
        if not self.cut_pids:
            return False
        try:
            port = client.getpeername()[1]
        except OSError:
            return False
        inode = _socket_inode(port, self.server.getsockname()[1])
        return inode is not None and any(_holds(pid, inode) for pid in list(self.cut_pids))

    def deafen(self) -> None:
        """Drop every byte the target sends from now on (requests still reach it)
        until :meth:`cut` and :meth:`heal` start over on fresh connections."""
        self.deaf.set()

    def hear(self) -> None:
        self.deaf.clear()

    def close(self) -> None:
        self.closed.set()
        self._thread.join(5)
        self.server.close()
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            self._sockets.clear()
            self._accepted.clear()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.cut_off.is_set() or self._from_cut_pid(client):
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
                self._accepted[client] = upstream
                self.accepted += 1
            for a, b, answers in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, answers), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not (answers and self.deaf.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._accepted.pop(src, None)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


def _socket_inode(local_port: int, remote_port: int) -> str | None:
    """The inode of this host's TCP socket 127.0.0.1:``local_port`` connected to
    127.0.0.1:``remote_port`` (/proc/net/tcp; Linux), if any."""
    want = (f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}")
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if (fields[1], fields[2]) == want:
            return fields[9]
    return None


def _holds(pid: int, inode: str) -> bool:
    """Whether process ``pid`` has socket ``inode`` open."""
    target = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
    return False


class HoldingProxy:
    """Forwards 127.0.0.1:<port> to ``target`` until the first request that carries
    ``marker`` (say an etcd key): from then on, what that one connection sends is held,
    not forwarded, and its peer sees nothing (no answer, no close), as on a stalled
    link. :meth:`release` forwards the request that carried the marker (what the
    connection sent within ``window`` seconds of it) and drops the rest: the store
    applies a call whose caller gave up long ago. Other connections pass untouched."""

    def __init__(self, target: str, marker: bytes, window: float = 0.3) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.marker = marker
        self.window = window
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.closed = threading.Event()
        #: when the marker was seen (time.monotonic()), None before
        self.marker_at: float | None = None
        self._lock = threading.Lock()
        self._held: list[tuple[float, bytes, socket.socket]] = []
        self._armed = True
        self._released = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                accepted, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                accepted.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [accepted, upstream]
            threading.Thread(target=self._up, args=(accepted, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, accepted), daemon=True).start()

    def _up(self, accepted: socket.socket, upstream: socket.socket) -> None:
        holding = False
        tail = b""
        with contextlib.suppress(OSError):
            while data := accepted.recv(65536):
                with self._lock:
                    if not holding and self._armed and self.marker in tail + data:
                        holding, self._armed = True, False
                        self.marker_at = time.monotonic()
                    if holding:
                        if not self._released:
                            self._held.append((time.monotonic(), data, upstream))
                        continue
                tail = (tail + data)[-len(self.marker) :]
                upstream.sendall(data)
        if not holding:  # (a held connection's upstream never sees its end: no cancel reaches the store)
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)

    @staticmethod
    def _down(upstream: socket.socket, accepted: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                accepted.sendall(data)

    def release(self) -> int:
        """Forward the held request; returns its bytes (what came later is dropped)."""
        with self._lock:
            assert self.marker_at is not None, "nothing was held"
            sent = 0
            for at, data, upstream in self._held:
                if at - self.marker_at <= self.window:
                    upstream.sendall(data)
                    sent += len(data)
            self._held, self._released = [], True
            return sent

    def close(self) -> None:
        self.closed.set()
        self.server.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
