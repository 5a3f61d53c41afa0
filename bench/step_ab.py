"""Two checkouts' remote scheduler steps, alternated in one run. Not a test.

    python bench/step_ab.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 3] [--running 16 64 256]
        [--steps 200] [--warmup 300]

This machine's speed drifts by 20-30 % over minutes (other tenants), more than many
changes are worth, so figures taken at different times cannot be compared. This runs
``bench/step.py``'s scheduler loop (its ``run``: the same seeded workload) for each
checkout in turn, ``--rounds`` times, each in a fresh process with its own server
process of that checkout, and prints per round and checkout, for each number of
running requests and both exclusive waiting modes (``exclusive``: a lookup per waiting
request; ``admit``: the waiting loop as one AdmitOp; both wait for every answer):

  p50      the step's median over the measured steps, ms
  server   the server process's CPU per step (all its threads, /proc), ms
  client   the median of the step less its time waiting on round trips, ms (the
           loop's own work and the client's)

Compare the two checkouts' rows of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()

_CHILD = """
import json, os, statistics, sys
root, running, steps, warmup = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
sys.path[:0] = [f"{root}/bench", f"{root}/client", f"{root}/server"]
import step as S
from common import freeze_heap
from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.testing import start_server

server = start_server("", env=dict(os.environ, PYTHONPATH=f"{root}/client:{root}/server"))
out = []
try:
    client = KVCoordClient(server.address, timeout=60)
    for n in running:
        for mode in ("exclusive", "admit"):
            name = f"p{n}-{mode}"
            client.create_pool(name, S.pool_config(n * 4600 // S.BS + 1))
            m = RemoteKVCacheManager(client, name, hash_seed="0", exclusive=True)
            freeze_heap()
            phases = []
            cpu0 = S.cpu_seconds(server.proc.pid)
            times, _ = S.run(m, n, warmup + steps, seed=n, admit=mode == "admit", phases=phases)
            cpu = (S.cpu_seconds(server.proc.pid) - cpu0) / (warmup + steps)
            times, phases = times[warmup:], phases[warmup:]
            own = [t - p[5] for t, p in zip(times, phases)]
            out.append([n, mode, statistics.median(times) * 1e3, cpu * 1e3, statistics.median(own) * 1e3])
            m.close()
            client.delete_pool(name)
finally:
    server.stop()
print(json.dumps(out))
"""


def measure(root: Path, running: list[int], steps: int, warmup: int) -> list[list[object]]:
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), ",".join(map(str, running)), str(steps), str(warmup)],
        env=env, capture_output=True, text=True, check=True, cwd=root,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path, help="a checkout of the code before the change")
    ap.add_argument("new", type=Path, help="a checkout of the code after it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=300)
    args = ap.parse_args()
    rows: dict[tuple[str, int, str], list[tuple[float, float, float]]] = {}
    print(
        f"{'round':>5} {'checkout':<8} {'running':>7} {'mode':<9} {'p50 ms':>7} {'server':>7} {'client':>7}"
    )
    for r in range(args.rounds):
        for label, root in (("old", args.old), ("new", args.new)):
            for n, mode, p50, server, own in measure(root.resolve(), args.running, args.steps, args.warmup):
                rows.setdefault((label, int(n), str(mode)), []).append((p50, server, own))  # type: ignore[arg-type]
                print(f"{r + 1:>5} {label:<8} {n:>7} {mode:<9} {p50:7.2f} {server:7.2f} {own:7.2f}")
    print("medians over the rounds (new / old):")
    for n in args.running:
        for mode in ("exclusive", "admit"):
            old, new = rows[("old", n, mode)], rows[("new", n, mode)]
            cols = [
                statistics.median(x[i] for x in new) / statistics.median(x[i] for x in old) for i in range(3)
            ]
            print(f"{n:>7} {mode:<9} p50 {cols[0]:.2f}  server {cols[1]:.2f}  client {cols[2]:.2f}")


if __name__ == "__main__":
    main()
