"""A journaled server process killed with SIGKILL and restarted: conformance traces and
many workers carry on as if nothing happened; a damaged journal stops the server."""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from durable_server import DurableServer, env
from durable_workload import PATIENT, run_checked_worker
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.conformance import load_trace, replay
from kvcoord.conformance.remote import RemoteTarget
from workload import check_pool, pool_config

ROOT = Path(__file__).resolve().parents[2]
TRACES = sorted((ROOT / "tests" / "conformance" / "data").glob("*.jsonl"))
KILLS_PER_TRACE = 5


class _Paced(list[dict[str, Any]]):
    """A trace's operations, released no faster than the kills: before operation i,
    ``(KILLS_PER_TRACE + 1) * i // n`` kills must have happened since the trace began,
    so every trace meets at least KILLS_PER_TRACE kills at random points inside it."""

    def __init__(self, ops: list[dict[str, Any]], seen: list[int]) -> None:
        super().__init__(ops)
        self.seen = seen

    def __iter__(self) -> Iterator[dict[str, Any]]:
        n = len(self)
        for i, op in enumerate(list.__iter__(self)):
            deadline = time.monotonic() + 120
            while self.seen[0] < (KILLS_PER_TRACE + 1) * i // n and time.monotonic() < deadline:
                time.sleep(0.01)
            yield op


class _Target(RemoteTarget):
    def close(self) -> None:
        try:
            if self.pool:
                self.client.delete_pool(self.pool)
        except KVCoordError:
            pass  # killed mid-delete: the pool may or may not be gone, either is fine
        finally:
            self.client.close()


def test_conformance_traces_survive_sigkill(tmp_path: Path) -> None:
    """Every conformance trace, replayed over the wire against a server process that
    is SIGKILLed and restarted at random moments (at least 5 times during each trace),
    still passes: block ids, hits, free-queue order, events and statistics."""
    server = DurableServer(tmp_path)
    server.start()
    rnd = random.Random(7)
    seen: dict[str, list[int]] = {}
    results: dict[str, Any] = {}
    running = set()
    lock = threading.Lock()

    def run(path: Path) -> None:
        trace = load_trace(path)
        counter = [0]
        with lock:
            seen[trace.name] = counter
            running.add(trace.name)
        try:
            paced = dataclasses.replace(trace, ops=_Paced(trace.ops, counter))
            results[trace.name] = replay(paced, _Target(server.address, retry=PATIENT))
        except Exception as exc:  # pragma: no cover - reported below
            results[trace.name] = exc
        finally:
            with lock:
                running.discard(trace.name)

    threads = [threading.Thread(target=run, args=(p,)) for p in TRACES]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        while any(t.is_alive() for t in threads) and server.kills < 200:
            time.sleep(rnd.uniform(0.05, 0.5))
            server.restart()
            with lock:
                for name in running:
                    seen[name][0] += 1
        for t in threads:
            t.join(60)
    finally:
        server.stop()
    failed = {n: r for n, r in results.items() if not getattr(r, "passed", False)}
    assert not failed, failed
    assert len(results) == len(TRACES) == 19
    assert min(c[0] for c in seen.values()) >= KILLS_PER_TRACE


def test_chaos_many_workers_lose_nothing(tmp_path: Path) -> None:
    """Four worker processes drive one pool while the server is SIGKILLed and restarted
    20 times: every worker's own record of its allocations matches the server after
    every step, no block is held by two live requests (checked after each restart and
    between), and no worker is ever told its requests were lost."""
    server = DurableServer(tmp_path)
    server.start()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    procs = []
    rnd = random.Random(11)
    samples = 0
    try:
        with KVCoordClient(server.address, timeout=20, retry=PATIENT) as c:
            c.create_pool("chaos", pool_config(300))
            procs = [
                ctx.Process(target=run_checked_worker, args=(server.address, "chaos", w, 500 + w, stop, out))
                for w in range(4)
            ]
            for p in procs:
                p.start()
            time.sleep(2.0)
            for _ in range(20):
                time.sleep(rnd.uniform(0.1, 0.8))
                server.restart()
                check_pool(c, "chaos", 300)
                samples += 1
            stop.set()
            reports = [out.get(timeout=120) for _ in procs]
            for p in procs:
                p.join(30)
            check_pool(c, "chaos", 300)
            stats = c.get_stats("chaos")
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()
    assert server.kills == 20 and samples == 20
    for r in reports:
        assert r["error"] == "", r
        assert r["lost"] == 0, r
        assert r["checks"] > 0 and r["allocs"] > 0, r
    assert stats.num_requests == 0 and stats.num_free_blocks == 299


def test_damaged_journal_stops_the_server_naming_the_file(tmp_path: Path) -> None:
    """An incompatible journal version or a corrupt snapshot: `kvcoord serve` exits
    non-zero with a message naming the journal file (never an empty start)."""
    server = DurableServer(tmp_path)
    server.start()
    with KVCoordClient(server.address) as c:
        c.create_pool("p", pool_config(50))
    server.stop()
    journal = server.data_dir / "journal.sqlite"

    def serve() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(server.config)],
            capture_output=True, text=True, env=env(), timeout=60,
        )  # fmt: skip

    db = sqlite3.connect(journal)
    db.execute(
        "INSERT INTO snapshots SELECT max(seq), 'x', x'00', x'01' FROM records"
    )  # a snapshot whose checksum fails
    db.commit()
    proc = serve()
    assert proc.returncode == 3
    assert f"journal {journal}: the snapshot after record" in proc.stderr and "corrupt" in proc.stderr
    db.execute("DELETE FROM snapshots")
    db.execute("UPDATE meta SET value = '0' WHERE key = 'format_version'")
    db.commit()
    db.close()
    proc = serve()
    assert proc.returncode == 3
    assert f"journal {journal} has format version 0" in proc.stderr
