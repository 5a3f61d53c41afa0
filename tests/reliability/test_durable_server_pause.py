"""DurableServer.paused holds the server's forked children too: a volume copy taken while
it is paused must not race a snapshot child renaming files (CI once failed with `cp -a`
exit 1 when only the parent was stopped)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from durable_server import DurableServer

# a parent that forks a child renaming files in ``argv[1]`` without pause, as a snapshot
# child writes ``.tmp`` and renames it into place
_FORKING = """
import os, sys, time
d = sys.argv[1]
if os.fork() == 0:
    n = 0
    while True:
        tmp = os.path.join(d, f"f{n}.tmp")
        with open(tmp, "w") as f:
            f.write("x")
        os.replace(tmp, os.path.join(d, f"f{n}"))
        n += 1
        if n % 50 == 0:
            for old in os.listdir(d):
                if old != f"f{n - 1}":
                    try:
                        os.unlink(os.path.join(d, old))
                    except FileNotFoundError:
                        pass
        time.sleep(0.001)
time.sleep(120)
"""


def _listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_paused_holds_forked_children(tmp_path: Path) -> None:
    d = tmp_path / "files"
    d.mkdir()
    server = DurableServer(tmp_path)
    server.proc = subprocess.Popen([sys.executable, "-c", _FORKING, str(d)])
    try:
        deadline = time.monotonic() + 30
        while len(_listing(d)) == 0:  # the child runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with server.paused():
            time.sleep(0.05)  # a signal in flight has landed
            before = _listing(d)
            time.sleep(0.3)
            assert _listing(d) == before, "a forked child went on writing while paused"
        deadline = time.monotonic() + 30
        while _listing(d) == before:  # and runs again after
            assert time.monotonic() < deadline, "the child was not resumed"
            time.sleep(0.01)
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(server.proc.pid)], check=False)
        server.proc.kill()
        server.proc.wait(10)
