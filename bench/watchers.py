"""A small call's latency while KV-event watchers follow a pool under eviction storms.

    PYTHONPATH=client:server python bench/watchers.py [--seconds 5] [--watchers 10]

One `kvcoord serve` process on loopback (durability none: the cost measured is the
streams'). A storm process steps back to back on pool "storm": each Step stores a fresh
1,024-token prompt (64 blocks of 16: one BlockStored of 1,024 token ids) and frees it,
so once the pool is full every Step also evicts 64 cached blocks (64 BlockRemoved).
Meanwhile the main process calls GetPool back to back and records each latency. Three
phases side by side in one run, each on a fresh server: no watcher; ``--watchers``
watchers (one process, a thread each) reading WatchEvents as fast as they can; the same
number of watchers that open their streams and never read (gRPC flow control then
suspends their streams on the server once their 64 KiB windows are full).

Prints, per phase: GetPool p50 / p99 / mean / max (ms), the number of calls, the storm's
Steps per second, the server's CPU (cores busy, and ms per storm Step: on a shared
machine steadier than latencies), and the events the watchers received.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

POOL = """
[[pools]]
name = "storm"
num_blocks = 8192
hash_block_size = 16
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true

[[pools.groups]]
type = "full"
block_size = 16
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    from kvcoord.client import KVCoordClient
    from kvcoord.client.errors import KVCoordError

    address = f"127.0.0.1:{_port()}"
    cfg = tmp / "kvcoord.toml"
    cfg.write_text(
        f'[server]\nlisten = ["{address}"]\nmetrics_listen = ""\ndurability = "none"\nlog_level = "WARNING"\n{POOL}'
    )
    env = {"PYTHONPATH": f"{ROOT / 'client'}:{ROOT / 'server'}", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    with KVCoordClient(address, timeout=1.0) as c:
        while time.monotonic() < deadline:
            try:
                if c.health() == "SERVING":
                    return proc, address
            except KVCoordError:
                time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def storm(address: str, stop: Any, steps: Any) -> None:
    """Store and free fresh 1,024-token prompts until ``stop`` is set."""
    from kvcoord.client import KVCoordClient
    from kvcoord.client.hashing import BlockHasher, none_hash
    from kvcoord.v1 import allocator_pb2 as pb

    with KVCoordClient(address, timeout=30) as c:
        r = c.attach("storm", "sha256_cbor", 16, "0")
        sid, fence = r.session_id, r.fence
        root = none_hash("sha256_cbor", "0")
        i = 0
        while not stop.is_set():
            prompt = [(i * 1024 + t) % 150_000 + 1 for t in range(1024)]
            hashes = BlockHasher("sha256_cbor", 16, root).extend(prompt)
            sync = pb.RequestSync(
                request_id=f"s{i}", append_token_ids=prompt, append_block_hashes=hashes, new_request=True
            )
            ops = [
                pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=1024)),
                pb.Operation(free=pb.FreeOp(request_id=f"s{i}")),
            ]
            c.step("storm", ops, sid, fence)
            i += 1
            steps.value = i


def watchers(address: str, n: int, read: bool, stop: Any, received: Any, ready: Any) -> None:
    """``n`` WatchEvents streams on one channel each, read (or never read) until ``stop``."""
    import grpc
    from kvcoord.v1 import allocator_pb2 as pb
    from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

    # A stalled reader's window stays at gRPC's initial 64 KiB (no BDP probing, which
    # on loopback grows it to megabytes: the stall would begin after the run).
    options = [] if read else [("grpc.http2.bdp_probe", 0)]
    channels = [grpc.insecure_channel(address, options=options) for _ in range(n)]
    streams = [pb_grpc.AllocatorStub(ch).WatchEvents(pb.WatchEventsRequest(pool="storm")) for ch in channels]
    counts = [0] * n

    def follow(i: int) -> None:
        try:
            for _ in streams[i]:
                counts[i] += 1
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(n)] if read else []
    for t in threads:
        t.start()
    ready.set()
    stop.wait()
    received.value = sum(counts)
    for s in streams:
        s.cancel()
    for ch in channels:
        ch.close()


def phase(n_watchers: int, read: bool, seconds: float) -> dict[str, float]:
    from kvcoord.client import KVCoordClient

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        proc, address = start_server(Path(d))
        try:
            stop, ready = ctx.Event(), ctx.Event()
            steps, received = ctx.Value("q", 0), ctx.Value("q", 0)
            procs = [ctx.Process(target=storm, args=(address, stop, steps))]
            if n_watchers:
                procs.append(
                    ctx.Process(target=watchers, args=(address, n_watchers, read, stop, received, ready))
                )
            else:
                ready.set()
            for p in procs:
                p.start()
            ready.wait(60)
            with KVCoordClient(address, timeout=30) as c:
                while steps.value < 20:  # the storm is under way
                    time.sleep(0.05)
                first = steps.value
                cpu0 = cpu_seconds(proc.pid)
                lat: list[float] = []
                t_end = time.monotonic() + seconds
                t0 = time.monotonic()
                while time.monotonic() < t_end:
                    s = time.perf_counter()
                    c.get_pool("storm")
                    lat.append(time.perf_counter() - s)
                elapsed = time.monotonic() - t0
                done = steps.value - first
                cpu = cpu_seconds(proc.pid) - cpu0
            stop.set()
            for p in procs:
                p.join(30)
        finally:
            proc.terminate()
            proc.wait(30)
    lat.sort()
    return {
        "calls": len(lat),
        "p50": lat[len(lat) // 2] * 1e3,
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "mean": statistics.fmean(lat) * 1e3,
        "max": lat[-1] * 1e3,
        "steps_per_s": done / elapsed,
        "server_cpu": cpu / elapsed,
        "cpu_per_step": cpu / max(done, 1) * 1e3,
        "events": received.value,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--watchers", type=int, default=10)
    args = ap.parse_args()
    rows = [
        ("no watcher", phase(0, True, args.seconds)),
        (f"{args.watchers} watchers reading", phase(args.watchers, True, args.seconds)),
        (f"{args.watchers} watchers stalled", phase(args.watchers, False, args.seconds)),
    ]
    print(f"GetPool latency during eviction storms ({args.seconds:g} s per phase)")
    print(f"{'phase':<22} {'calls':>7} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'max ms':>8} {'storm steps/s':>14} {'server cores':>13} {'ms/step':>8} {'events read':>12}")  # fmt: skip
    for name, r in rows:
        print(
            f"{name:<22} {r['calls']:>7} {r['p50']:>8.2f} {r['p99']:>8.2f} {r['mean']:>8.2f} {r['max']:>8.2f} "
            f"{r['steps_per_s']:>14.1f} {r['server_cpu']:>13.2f} {r['cpu_per_step']:>8.2f} {r['events']:>12}"
        )


if __name__ == "__main__":
    main()
