"""A server process paused longer than a lease (SIGSTOP, as a stalled VM, a stopped
container or a long event-loop block) keeps the sessions its clients renewed all along.

Before, the time it was stopped ran the leases down: when it ran again, the reaper, or
the renewal that had waited in its socket finding its own session past the lease, ended
every session before the renewals queued during the pause were read, and workers that
did everything right lost their sessions and every request. The server's lease clock
now leaves out the time it could not run (lease_clock.py). A worker that really died
still loses its session: one lease after its last renewal, the pause not counted.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import durable_server
from durable_server import DurableServer, attach, held_first_group, leased_server, step_allocate
from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.errors import SessionExpiredError
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from support import Req

LEASE = 2.0
#: the server held stopped this long: 2.5 leases
PAUSE = 5.0
#: a bound on what a loaded machine takes to answer after the pause (2 cores, load 25+)
SLACK = 30.0


class Renewer(threading.Thread):
    """Plain renewals of ``session`` every quarter lease until :attr:`stop` (a call sent
    during a pause waits for the server: 30 s deadline). ``expired``: the
    SessionExpiredError that ended it; ``answered``: monotonic times of the answers."""

    def __init__(self, c: KVCoordClient, session: Any) -> None:
        super().__init__(name="renewer", daemon=True)
        self.c, self.session = c, session
        self.stop = threading.Event()
        self.expired: SessionExpiredError | None = None
        self.answered: list[float] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.c.heartbeat(self.session.session_id, self.session.fence)
            except SessionExpiredError as err:
                self.expired = err
                return
            self.answered.append(time.monotonic())
            self.stop.wait(LEASE / 4)


def _until(done: Callable[[], bool], what: str) -> None:
    """Wait until ``done()`` (at most :data:`SLACK` s, else fail naming ``what``)."""
    deadline = time.monotonic() + SLACK
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _pauses(metrics: str) -> tuple[float, float]:
    """``kvcoord_server_pauses_total`` and ``kvcoord_server_paused_seconds_total`` from a
    scrape of the server's /metrics (``metrics``: its address)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=SLACK) as answer:
        text = answer.read().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return samples["kvcoord_server_pauses_total"], samples["kvcoord_server_paused_seconds_total"]


def test_sessions_renewed_all_along_outlive_a_server_paused_past_their_lease(tmp_path: Path) -> None:
    server = leased_server(tmp_path, LEASE, 64)
    metrics = f"127.0.0.1:{free_port()}"
    server.config.write_text(
        server.config.read_text().replace('metrics_listen = ""', f'metrics_listen = "{metrics}"')
    )
    server.start()
    renewer: Renewer | None = None
    try:
        pauses_before, _ = _pauses(metrics)
        with (
            KVCoordClient(server.address, timeout=SLACK) as c,
            KVCoordClient(server.address, timeout=SLACK) as c2,
        ):
            m = RemoteKVCacheManager(c, "p", hash_seed="0", client_name="worker", lease_seconds=LEASE)
            blocks = m.allocate_slots(Req("a0", list(range(8))), 8)
            assert blocks is not None
            got = {"a0": list(blocks.get_block_ids()[0])}
            plain = attach(c2, "plain", LEASE)
            got["b0"] = step_allocate(c2, plain, "b0", 8)
            renewer = Renewer(c2, plain)
            renewer.start()
            time.sleep(LEASE / 2)  # both renew (the keeper every third of the lease)
            renewals = m.keeper.renewals
            with server.paused():
                time.sleep(PAUSE)
            resumed = time.monotonic()
            # a renewal of each is answered after the pause (or told the session ended)
            r = renewer
            _until(lambda: r.expired is not None or any(t > resumed for t in r.answered), "no plain renewal")
            _until(lambda: m.keeper.lost is not None or m.keeper.renewals > renewals + 1, "no keeper renewal")
            assert renewer.expired is None, renewer.expired
            assert m.keeper.lost is None, m.keeper.lost
            # their next calls succeed and every block is where it was
            blocks = m.allocate_slots(Req("a1", list(range(100, 108))), 8)
            assert blocks is not None
            got["a1"] = list(blocks.get_block_ids()[0])
            got["b1"] = step_allocate(c2, plain, "b1", 8)
            assert held_first_group(c) == got
            assert "the server did not run for" in server.log()  # it saw the pause
            # and counts it for dashboards: at least this pause, less its tick and the slack
            # of the signals' delivery (loaded machines add gaps of their own)
            pauses, paused = _pauses(metrics)
            assert pauses >= pauses_before + 1 and paused >= PAUSE - 1.0, (pauses, paused)
            renewer.stop.set()
            renewer.join(SLACK)
            m.close()
    finally:
        if renewer is not None:
            renewer.stop.set()
        server.stop()


#: a worker process: attaches to pool ``p``, allocates ``dead0``, prints its session id
#: and renews every quarter lease until it is killed
_WORKER = """
import sys, time
sys.path.insert(0, {tests!r})
from durable_server import attach, step_allocate
from kvcoord.client import KVCoordClient

with KVCoordClient({address!r}, timeout=30.0) as c:
    s = attach(c, "doomed", {lease!r})
    step_allocate(c, s, "dead0", 8)
    print(s.session_id, flush=True)
    while True:
        time.sleep({lease!r} / 4)
        c.heartbeat(s.session_id, s.fence)
"""


def _sessions(c: KVCoordClient) -> dict[str, float]:
    return {s.session_id: s.expires_in_seconds for s in c.list_sessions("p").sessions}


def test_a_killed_workers_session_still_ends_after_a_server_pause(tmp_path: Path) -> None:
    server: DurableServer = leased_server(tmp_path, LEASE, 64)
    server.start()
    source = _WORKER.format(tests=str(Path(__file__).parents[1]), address=server.address, lease=LEASE)
    worker = subprocess.Popen(
        [sys.executable, "-c", source], stdout=subprocess.PIPE, env=durable_server.env(), text=True
    )
    try:
        assert worker.stdout is not None
        session_id = worker.stdout.readline().strip()
        assert session_id, "the worker did not attach"
        with KVCoordClient(server.address, timeout=SLACK) as c:
            assert "dead0" in held_first_group(c)
            time.sleep(LEASE / 2)  # it renews a few times
            worker.kill()
            worker.wait(SLACK)
            with server.paused():
                time.sleep(PAUSE)
            _until(lambda: session_id not in _sessions(c), "the dead worker's session never ended")
            assert "dead0" not in held_first_group(c)  # its requests were freed
            log = server.log()
            assert f"session {session_id} (doomed) of pool p expired" in log, log
            assert "the server did not run for" in log, log  # it saw the pause, and ended it still
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(SLACK)
        if worker.stdout is not None:
            worker.stdout.close()
        server.stop()
