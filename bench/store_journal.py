"""What the journal in the cluster store costs per Step ([cluster] journal = "store"
against "local"), in one run, on loopback.

    PYTHONPATH=client:server python bench/store_journal.py [--steps 1000] [--seconds 4] [--threads 8]

Each mode runs one fresh clustered `kvcoord serve` replica (data_dir on the local
disk, synchronous NORMAL) against a fresh etcd started here (`etcd` on PATH): the
local journal only; the store journal with a 1-member etcd; the store journal with a
3-member etcd (a Raft quorum: every commit is replicated before it is answered). The
Step is bench/durability.py's (allocate a 64-token request, free the previous one).
Latency is one client, steps back to back; throughput is ``--threads`` clients at
once (their records are grouped into one etcd transaction per pool and batch).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from durability import POOL, ROOT, _port, measure
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import KVCoordError

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cluster")]
from etcd_process import Etcd, EtcdCluster  # noqa: E402 - the tests' etcd starters


def start(tmp: Path, endpoints: list[str], journal: str) -> tuple[subprocess.Popen[bytes], str]:
    address = f"127.0.0.1:{_port()}"
    listed = ", ".join(f'"{e}"' for e in endpoints)
    cfg = tmp / f"{journal}.toml"
    cfg.write_text(
        f'[server]\nlisten = ["{address}"]\nmetrics_listen = ""\nlog_level = "WARNING"\n'
        f'data_dir = "{tmp / "data"}"\nsynchronous = "NORMAL"\n'
        f'[cluster]\nendpoints = [{listed}]\nname = "bench"\nreplica_id = "b0"\njournal = "{journal}"\n'
        f"lease_seconds = 10\n{POOL}"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    with KVCoordClient(address, timeout=1) as c:
        while time.monotonic() < deadline:
            try:
                if any(p.name == "bench" for p in c.list_pools().pools):
                    return proc, address
            except KVCoordError:
                pass
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("replica did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; {args.steps} sequential steps, "
          f"{args.threads} threads x {args.seconds}s")  # fmt: skip
    print(f"{'journal':<22}{'p50 ms':>9}{'p99 ms':>9}{'1 client st/s':>15}{'N clients st/s':>16}")
    for label, journal, members in (
        ("local", "local", 1),
        ("store, etcd x1", "store", 1),
        ("store, etcd x3", "store", 3),
    ):
        tmp = Path(tempfile.mkdtemp(prefix="kvcoord-bench-store-"))
        etcd: Etcd | EtcdCluster = Etcd(tmp) if members == 1 else EtcdCluster(tmp, members)
        endpoints = [etcd.endpoint] if isinstance(etcd, Etcd) else etcd.endpoints
        proc, address = start(tmp, endpoints, journal)
        try:
            r = measure(address, args.steps, args.seconds, args.threads)
        finally:
            proc.kill()
            proc.wait()
            etcd.stop()
        print(
            f"{label:<22}{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['seq_steps_s']:>15.0f}{r['par_steps_s']:>16.0f}"
        )


if __name__ == "__main__":
    main()
