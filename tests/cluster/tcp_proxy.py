"""A TCP proxy on loopback that a test can cut (every connection closed, new ones
refused at once) and heal: a partition between one process and another; or deafen
(what the target answers is dropped, what it is sent still reaches it): a request
that is carried out while its answer is lost."""

from __future__ import annotations

import contextlib
import socket
import threading


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
        #: connections accepted and forwarded so far
        self.accepted = 0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Close every connection; refuse new ones until :meth:`heal`."""
        self.cut_off.set()
        self._close_all()

    def heal(self) -> None:
        self.cut_off.clear()

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

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.cut_off.is_set():
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
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
