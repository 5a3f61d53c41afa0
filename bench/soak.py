"""A long run with the journal on: expired sessions, server memory, data-directory size
and journal bytes per block operation over time. Not a test.

    PYTHONPATH=client:server python bench/soak.py [--minutes 10] [--workers 8] [--running 12]

One ``kvcoord serve`` process with the default configuration (the default pool, the
journal in ``kvcoord-data`` under a temporary directory (``KVCOORD_DATA_DIR``), default snapshot and
lease settings, metrics off) and ``--workers`` worker processes attached to the
default pool, each a vLLM-scheduler-like loop (bench/workers.py's ``Worker``: every
step frees finished requests, prefills new ones and appends one decode token to each
of ``--running`` requests) sending one keyed ``Step`` per scheduler step with
``include_state`` (each worker collects the events of every other worker, as a KV
router-fed scheduler does). Every ``--every`` seconds it prints: block operations so
far, the server's RSS, the data directory's size (journal, WAL, snapshot files), the
journal's records and snapshots, and the bytes of the records appended since the last
sample per block operation (read from the journal file: records a snapshot deleted
before they were sampled are not counted, so this is a lower bound; sampling every
second keeps that small). At the end: sessions that expired (the server's log), and
the growth of RSS and data directory after the first third of the run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "bench")]

from common import free_port, rss_mib, wait_serving  # noqa: E402
from workers import Worker  # noqa: E402


class SoakWorker(Worker):
    def run_until(self, deadline: float, done: Any) -> None:
        """Scheduler steps until ``deadline``, adding the block operations to ``done``."""
        while time.monotonic() < deadline:
            ops = self.step_ops()
            resp = self.client.step(self.pool, ops, self.session, self.fence, include_state=True)
            for op, res in zip(ops, resp.results, strict=True):
                self._check(res)
                self._applied(op)
            with done.get_lock():
                done.value += len(ops)


def worker_main(idx: int, address: str, running: int, deadline: float, done: Any, errors: Any) -> None:
    try:
        w = SoakWorker(idx, address, "default", running, seed=2000 + idx)
        w.run_until(deadline, done)
        w.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        errors.put(f"worker {idx}: {type(exc).__name__}: {exc}")


def dir_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / (1 << 20)


class JournalReader:
    """Bytes of the records appended since the last read (read-only, short reads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last_seq = 0

    def read(self) -> tuple[int, int, int]:
        """(new record bytes, records now in the file, snapshots in the file)."""
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        try:
            new, top = db.execute(
                "SELECT coalesce(sum(length(body)), 0), coalesce(max(seq), 0) FROM records WHERE seq > ?",
                (self.last_seq,),
            ).fetchone()
            (records,) = db.execute("SELECT count(*) FROM records").fetchone()
            (snaps,) = db.execute("SELECT count(*) FROM snapshots").fetchone()
        finally:
            db.close()
        self.last_seq = max(self.last_seq, int(top))
        return int(new), int(records), int(snaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--running", type=int, default=12, help="running requests per worker")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between journal samples")
    ap.add_argument("--print-every", type=float, default=30.0, help="seconds between printed lines")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvcoord-soak-"))
    data = work / "kvcoord-data"
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT / "server")]),
        KVCOORD_DATA_DIR=str(data),  # the default config's, made absolute, in the temporary directory
    )
    env.pop("KVCOORD_CONFIG", None)
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvcoord.service.cli", "serve", "--listen", f"127.0.0.1:{port}",
             "--metrics-listen", ""],
            cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    wait_serving(address)
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; server and "
        f"{args.workers} workers share them"
    )
    print(f"workload: {args.workers} workers x {args.running} running requests, default pool, "
          f"include_state on every Step, {args.minutes:g} min")  # fmt: skip
    ctx = mp.get_context("spawn")
    done = ctx.Value("q", 0)
    errors = ctx.Queue()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    procs = [
        ctx.Process(target=worker_main, args=(i, address, args.running, deadline, done, errors), daemon=True)
        for i in range(args.workers)
    ]
    for p in procs:
        p.start()
    reader = JournalReader(data / "journal.sqlite")
    total_bytes = 0
    samples: list[tuple[float, int, float, float]] = []
    last_print = 0.0
    last_ops = 0
    last_bytes = 0
    print(f"{'min':>6} {'block ops':>10} {'RSS MiB':>8} {'data MiB':>9} {'records':>8} {'snaps':>5} "
          f"{'bytes/op':>9} {'ops/s':>7}")  # fmt: skip
    try:
        while time.monotonic() < deadline + 5 and any(p.is_alive() for p in procs):
            time.sleep(args.every)
            now = time.monotonic() - start
            try:
                new, records, snaps = reader.read()
            except sqlite3.Error:
                continue
            total_bytes += new
            ops = done.value
            rss, size = rss_mib(server.pid), dir_mib(data)
            samples.append((now, ops, rss, size))
            if now - last_print >= args.print_every:
                window_ops = ops - last_ops
                per_op = (total_bytes - last_bytes) / window_ops if window_ops else 0.0
                rate = window_ops / (now - last_print) if last_print or now else 0.0
                print(f"{now / 60:6.1f} {ops:10d} {rss:8.0f} {size:9.1f} {records:8d} {snaps:5d} "
                      f"{per_op:9.1f} {rate:7.0f}", flush=True)  # fmt: skip
                last_print, last_ops, last_bytes = now, ops, total_bytes
    finally:
        for p in procs:
            p.join(30)
        server.terminate()
        server.wait(120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    text = log_path.read_text(errors="replace")
    expired = len(re.findall(r"session \S+ \(.*\) of pool \S+ expired", text))
    ops = done.value
    print(
        f"block operations: {ops}; journal record bytes per block operation: {total_bytes / max(ops, 1):.1f}"
    )
    print(f"expired sessions: {expired}; worker errors: {len(failures)}")
    for f in failures[:5]:
        print("  " + f)
    if samples:
        third = [s for s in samples if s[0] >= samples[-1][0] / 3]
        rss_values = [s[2] for s in third]
        size_values = [s[3] for s in samples]
        print(f"server RSS after the first third: min {min(rss_values):.0f} MiB, max {max(rss_values):.0f} MiB, "
              f"end {samples[-1][2]:.0f} MiB")  # fmt: skip
        print(f"data directory: max {max(size_values):.1f} MiB, end {samples[-1][3]:.1f} MiB "
              f"(after the clean stop: {dir_mib(data):.1f} MiB)")  # fmt: skip
    print(f"server log: {log_path}")


if __name__ == "__main__":
    main()
