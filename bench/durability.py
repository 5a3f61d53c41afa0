"""What durability costs: Step latency and throughput with the journal off and on (each
fsync policy), journal bytes per operation, and recovery time per million operations.

    PYTHONPATH=client:server python bench/durability.py [--steps 2000] [--seconds 4] [--threads 8]

Each mode runs a fresh `kvcoord serve` process on loopback. A Step here is a scheduler
step of one worker: allocate a new 64-token request (full + sliding-window groups,
prefix caching on, hashes sent) and free the one allocated before. Latency is one
client, steps back to back; throughput is ``--threads`` clients at once (their
commits are grouped). Recovery is measured by recovering the journal of the
``FULL`` run (snapshots off, so every record is replayed) in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvcoord.client import KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import allocate_op

ROOT = Path(__file__).resolve().parents[1]
POOL = """
[[pools]]
name = "bench"
num_blocks = 4096
hash_block_size = 16
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true
[[pools.groups]]
type = "full"
block_size = 16
[[pools.groups]]
type = "sliding_window"
block_size = 16
sliding_window = 128
"""
NONE = none_hash("sha256_cbor", "0")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(tmp: Path, mode: str, synchronous: str) -> tuple[subprocess.Popen[bytes], str]:
    address = f"127.0.0.1:{_port()}"
    cfg = tmp / f"{mode}-{synchronous}.toml"
    cfg.write_text(
        f'[server]\nlisten = ["{address}"]\nmetrics_listen = ""\nlog_level = "WARNING"\n'
        f'data_dir = "{tmp / "data"}"\ndurability = "{mode}"\nsynchronous = "{synchronous}"\n'
        f"snapshot_every = 100000000\n{POOL}"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    with KVCoordClient(address, timeout=1) as c:
        for _ in range(600):
            try:
                if c.health() == "SERVING":
                    return proc, address
            except KVCoordError:
                time.sleep(0.05)
    raise RuntimeError("server did not start")


class Worker:
    """One client's steps: allocate a fresh request, free the previous one."""

    def __init__(self, address: str, name: str) -> None:
        self.client = KVCoordClient(address, timeout=30)
        att = self.client.attach("bench", "sha256_cbor", 16, "0", name)
        self.session, self.fence = att.session_id, att.fence
        self.name = name
        self.n = 0
        self.prev = ""

    def step(self) -> None:
        self.n += 1
        rid = f"{self.name}-{self.n}"
        tokens = [(self.n * 131 + i) % 30000 for i in range(64)]
        sync = pb.RequestSync(
            request_id=rid, append_token_ids=tokens, new_request=True,
            append_block_hashes=BlockHasher("sha256_cbor", 16, NONE).extend(tokens),
        )  # fmt: skip
        ops = [pb.Operation(allocate=allocate_op(sync, 64))]
        if self.prev:
            ops.append(pb.Operation(free=pb.FreeOp(request_id=self.prev)))
        self.client.step("bench", ops, self.session, self.fence)
        self.prev = rid


def measure(address: str, steps: int, seconds: float, threads: int) -> dict[str, float]:
    w = Worker(address, "lat")
    for _ in range(100):
        w.step()
    lat = []
    for _ in range(steps):
        t = time.perf_counter()
        w.step()
        lat.append(time.perf_counter() - t)
    lat.sort()
    workers = [Worker(address, f"t{i}") for i in range(threads)]
    done = [0] * threads
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        while time.monotonic() < stop:
            workers[i].step()
            done[i] += 1

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    start_t = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - start_t
    return {
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
        "seq_steps_s": len(lat) / sum(lat),
        "par_steps_s": sum(done) / elapsed,
        "steps": len(lat) + sum(done) + 100,
    }


def recovery_seconds(data_dir: Path) -> tuple[float, int, int]:
    """Recover a copy of ``data_dir`` in this process; (seconds, records, body bytes)."""
    from kvcoord.service.idempotency import IdempotencyStore
    from kvcoord.service.recovery import open_journal
    from kvcoord.service.registry import Limits, PoolRegistry
    from kvcoord.service.sessions import SessionTable

    copy = Path(tempfile.mkdtemp(prefix="kvcoord-recover-")) / "data"
    shutil.copytree(data_dir, copy)
    import sqlite3

    db = sqlite3.connect(copy / "journal.sqlite")
    records, body = db.execute("SELECT count(*), sum(length(body)) FROM records").fetchone()
    db.close()

    async def run() -> float:
        reg = PoolRegistry(
            Limits(), SessionTable(time.monotonic, 30, 120), IdempotencyStore(time.monotonic, 300, 64 << 20)
        )
        rec = open_journal(reg, str(copy), "OFF", 10**9)
        await rec.recorder.journal.close()
        return rec.seconds

    seconds = asyncio.run(run())
    shutil.rmtree(copy.parent)
    return seconds, int(records), int(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; {args.steps} sequential steps, "
          f"{args.threads} threads x {args.seconds}s")  # fmt: skip
    print(
        f"{'mode':<16}{'p50 ms':>9}{'p99 ms':>9}{'1 client st/s':>15}{'N clients st/s':>16}{'file B/op':>11}"
    )
    full_dir = None
    for mode, sync in (("none", "FULL"), ("journal", "OFF"), ("journal", "NORMAL"), ("journal", "FULL")):
        tmp = Path(tempfile.mkdtemp(prefix="kvcoord-bench-"))
        proc, address = start(tmp, mode, sync)
        try:
            r = measure(address, args.steps, args.seconds, args.threads)
        finally:
            proc.kill()
            proc.wait()
        label = "none" if mode == "none" else f"journal {sync}"
        size = 0
        data = tmp / "data"
        for f in ("journal.sqlite", "journal.sqlite-wal"):
            if (data / f).exists():
                size += (data / f).stat().st_size
        per_op = f"{size / r['steps']:.0f}" if mode == "journal" else "-"
        print(f"{label:<16}{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['seq_steps_s']:>15.0f}"
              f"{r['par_steps_s']:>16.0f}{per_op:>11}")  # fmt: skip
        if sync == "FULL" and mode == "journal":
            full_dir = data
        else:
            shutil.rmtree(tmp)
    assert full_dir is not None
    seconds, records, body = recovery_seconds(full_dir)
    shutil.rmtree(full_dir.parent)
    print(f"journal record bytes per Step: {body / records:.0f} (CBOR: request + answer + key)")
    print(f"recovery: {records} records in {seconds:.2f} s -> {seconds / records * 1e6:.0f} s per million "
          "journaled Steps (extrapolated linearly; replay without snapshots)")  # fmt: skip


if __name__ == "__main__":
    main()
