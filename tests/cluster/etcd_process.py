"""A real etcd for the cluster tests: loopback, a temporary data directory, free ports,
bounded waits. Without the binary the tests are skipped, unless KVCOORD_REQUIRE_ETCD=1
(CI, .ci/run) makes that a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from durable_server import free_port

REQUIRE = os.environ.get("KVCOORD_REQUIRE_ETCD") == "1"


class Etcd:
    """One etcd member on 127.0.0.1; :attr:`endpoint` is its client host:port."""

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            message = "etcd is not installed (apt-get install etcd-server; make install does)"
            if REQUIRE:
                pytest.fail(f"KVCOORD_REQUIRE_ETCD=1: {message}")
            pytest.skip(message)
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log_path = tmp / "etcd.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        data = tempfile.mkdtemp(prefix="etcd-", dir=tmp)
        self.proc = subprocess.Popen(
            [binary, "--name", "t", "--data-dir", data,
             "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._wait_ready(30.0)

    def _wait_ready(self, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_path.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"etcd did not listen within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
