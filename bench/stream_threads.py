"""Where a streamed Step's server CPU goes, thread by thread. Not a test.

    PYTHONPATH=client:server python bench/stream_threads.py [--running 256] [--steps 2000] \
        [--warmup 100] [--shape packed] [--py-spy OUT.txt] [--metrics]

One ``kvcoord serve`` process (this checkout's, memory only) fed decode_cpu.py's
recorded Steps in ``--shape`` on the client's StepStream. Over the measured Steps it
prints each server thread's CPU (``/proc/PID/task/*/stat``, clock ticks) per Step and
per block operation, by thread name, and the process total (Linux's CPU clock).
``--py-spy OUT``: ``py-spy record --native`` of the server over the measured Steps
(raw collapsed stacks, thread ids kept) written to OUT.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_cpu as D  # noqa: E402


def threads(pid: int) -> dict[int, tuple[str, int]]:
    """Each thread of ``pid``: its name and CPU so far (clock ticks, user + system)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        out[int(tid)] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--shape", default="packed", choices=["ops", "run", "columnar", "packed"])
    ap.add_argument("--metrics", action="store_true", help="also serve /metrics")
    ap.add_argument("--py-spy", dest="py_spy", help="write py-spy's collapsed stacks here")
    args = ap.parse_args()
    D._paths(D.ROOT)
    import workers as W
    from kvcoord.client.testing import start_server
    from kvcoord.v1 import allocator_pb2 as pb

    trace = Path(tempfile.mkdtemp(prefix="kvcoord-stream-threads-")) / "trace.bin"
    D.build(args.running, args.warmup + args.steps, trace)
    bodies = D.load(trace)
    reqs = [D.shaped(pb, b, args.shape) for b in bodies]
    ops_n = sum(D.weight(b, pb) for b in bodies[args.warmup :])
    env = dict(os.environ, PYTHONPATH=D.code_path("new", D.ROOT))
    server = start_server(W.config_text("none", "", "FULL"), env=env, metrics=args.metrics)
    run: dict = {"server": server}
    spy = None
    try:
        D.open_session(run, server.address, args.running, step_stream=True)
        pid = server.proc.pid
        att = run["att"]
        for k, ops in enumerate(reqs):
            if k == args.warmup:
                if args.py_spy:
                    spy = subprocess.Popen(
                        ["py-spy", "record", "--native", "--threads", "--rate", "1000", "--format", "raw",
                         "-o", args.py_spy, "-p", str(pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                    time.sleep(1.0)  # (py-spy attaches)
                before, cpu0, t0 = threads(pid), D.server_cpu(pid), time.perf_counter()
            run["client"].step("p", ops, att.session_id, att.fence)
        after, cpu, wall = threads(pid), D.server_cpu(pid) - cpu0, time.perf_counter() - t0
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
        run["client"].detach(att.session_id, att.fence)
    finally:
        D.close_runs({0: run})
    tick = os.sysconf("SC_CLK_TCK")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{args.running} running, {args.steps} measured Steps ({ops_n} ops), {args.shape}; load average {load}"
    )
    print(
        f"process: {cpu / args.steps * 1e3:.3f} ms CPU/Step, {cpu / ops_n * 1e6:.2f} µs/op; wall {wall:.1f} s"
    )
    by_name: dict[str, float] = {}
    for tid, (name, ticks) in after.items():
        used = (ticks - before.get(tid, (name, 0))[1]) / tick
        by_name[name] = by_name.get(name, 0.0) + used
    for name, used in sorted(by_name.items(), key=lambda kv: -kv[1]):
        if used:
            print(f"  {name:24} {used / args.steps * 1e3:7.3f} ms/Step {used / ops_n * 1e6:6.2f} µs/op")


if __name__ == "__main__":
    main()
