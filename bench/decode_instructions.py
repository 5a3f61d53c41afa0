"""Instructions per block operation of the Step path, counted by valgrind (not a test).

    PYTHONPATH=client:server python bench/decode_instructions.py [--running 256] \
        [--shape columnar] [--old REV] [--warmup 600]

A load-independent companion of bench/decode_cpu.py (whose CPU times move by 10-30 %
with other jobs on the machine): the same recorded workload (decode_cpu.py's
``build``), applied to one pool of each code without gRPC or asyncio (each Step
parsed from its bytes, ``mutating_calls.apply_step``, the answer serialized; no session
renewal, idempotency key or kept answer), under ``valgrind --tool=cachegrind``. The
instructions of 10 measured Steps are subtracted from those of 40 (after ``--warmup``
Steps, 100 by default; from about 500 at 256 running the pool's event buffer is full,
so that every Step also drops the oldest events), so start-up, warm-up and the
building of every Step (done whatever the count) cancel out. About 2 minutes per code
and shape (5 with ``--warmup 600``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
WARM, LOW, HIGH = 100, 10, 40  # (WARM: --warmup's default)


def child(tree: Path, trace: Path, shape: str, steps: int, warm: int) -> None:
    """Apply the trace's Steps (``warm``, then ``steps`` more) with ``tree``'s code."""
    sys.path[:0] = [str(tree / "client"), str(tree / "server")]
    import decode_cpu as D  # (this checkout's; imports no kvcoord module)

    try:
        from kvcoord.service.mutating_calls import apply_step
    except ImportError:  # a tree from before the servicer's split
        from kvcoord.service.servicer import _apply_step as apply_step  # type: ignore[attr-defined,no-redef]
    from kvcoord.service.pool_service import Fence, Limits, PoolService
    from kvcoord.service.sessions import SessionTable
    from kvcoord.service.testing import ManualClock
    from kvcoord.v1 import allocator_pb2 as pb
    from kvcoord.wire import config_from_pb

    pool = json.loads(trace.with_suffix(".pool.json").read_text())
    algo, bs, seed = pool["attach"]
    config = config_from_pb(pb.PoolConfig.FromString(bytes.fromhex(pool["config"])))
    p = PoolService(
        "p", config, (algo, bs, seed), Fence("i", 1), Limits(), SessionTable(ManualClock(), 30, 60)
    )
    s = p.attach(algo, bs, seed, "bench", 0)
    # every Step of the longest run is built, whatever ``steps``: building them (the
    # shape, serialization) is the benchmark's own work and must cancel out
    bodies = D.load(trace)[: warm + HIGH]
    wire = [
        pb.StepRequest(pool="p", session_id=s.session_id, ops=D.shaped(pb, b, shape)).SerializeToString()
        for b in bodies
    ]
    for body in wire[: warm + steps]:
        apply_step(p, s, pb.StepRequest.FromString(body), p.fence, 0).SerializeToString()


def instructions(tree: Path, trace: Path, shape: str, steps: int, tmp: Path, warm: int) -> int:
    out = tmp / "cachegrind.out"
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
           sys.executable, str(HERE), "child", str(tree), str(trace), shape, str(steps), str(warm)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    err = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stderr
    m = re.search(r"I\s+refs:\s+([\d,]+)", err)
    assert m is not None, err[-2000:]
    return int(m.group(1).replace(",", ""))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--shape", default="columnar", choices=["ops", "run", "columnar"])
    ap.add_argument("--old", help="a git revision to compare against (its client and server)")
    ap.add_argument("--warmup", type=int, default=WARM, help="Steps applied before the counted ones")
    args = ap.parse_args()
    warm = args.warmup
    sys.path[:0] = [str(HERE.parent), str(ROOT / "client"), str(ROOT / "server")]
    import decode_cpu as D
    from common import old_tree
    from kvcoord.v1 import allocator_pb2 as pb

    tmp = Path(tempfile.mkdtemp(prefix="kvcoord-decode-instr-"))
    trace = tmp / "trace.bin"
    D.build(args.running, warm + HIGH, trace)
    ops = sum(D.weight(b, pb) for b in D.load(trace)[warm + LOW : warm + HIGH])
    trees = {"new": ROOT} if not args.old else {"old": old_tree(args.old), "new": ROOT}
    for name, tree in trees.items():
        t0 = time.monotonic()
        diff = instructions(tree, trace, args.shape, HIGH, tmp, warm) - instructions(
            tree, trace, args.shape, LOW, tmp, warm
        )
        print(f"{name}: {diff / ops:,.0f} instructions per operation ({args.shape}, {args.running} running; "
              f"{time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
