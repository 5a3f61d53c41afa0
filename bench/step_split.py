"""Where a served Step's CPU goes: the handler, the loop thread around it, the other threads. Not a test.

    PYTHONPATH=client:server python bench/step_split.py [--running 64 256] [--steps 1000] \
        [--warmup 100] [--old REV] [--rounds 3] [--metrics] [--loop-detail] [--stream] [--shape packed] \
        [--new-env KEY=VALUE ...]

The Steps are decode_cpu.py's (one workers.py worker's scheduler, ``--running``
requests in decode, the columnar shape; ``--shape packed``: its DecodeOps' columns
packed, what the predicting client sends, which only code since fix-cols23 reads), sent unary one after another from one client (``--stream``: as
the messages of the client's StepStream, one at a time).
Each code (this checkout, and with ``--old REV`` that revision's client and server)
runs as a ``kvcoord serve`` process started through this file's ``serve`` mode, which
wraps ``AllocatorServicer.Step`` (before the server registers it) to add up the loop
thread's CPU inside it (``time.thread_time``, its awaits included: one client, one
call at a time, so nothing else runs then). All the codes serve at once and each Step
goes to every server in turn (which goes first alternates), as in decode_cpu.py. Per
Step, for each code:

  handler   CPU inside ``AllocatorServicer.Step`` (MutationRunner.run and its answer)
  loop-out  the loop thread's CPU (``/proc/PID/task/PID/schedstat``, ns) minus the handler:
            gRPC aio's call handling on the loop, the interceptors, the guard, the request's
            parse and bounds check, the answer's serialization, the event loop itself
  other     the process's CPU (Linux's process CPU clock) minus the loop thread's: gRPC's
            poller threads, the metrics HTTP thread when served
  gc        of the loop thread's, CPU in cyclic collections (gc.callbacks) and their count
  bounds    of loop-out, the input bounds check (servicer's ``check_request_slices``)
  parse     of loop-out, the request parsed from its bytes (servicer's ``parse_in_turns``)
  select    with ``--loop-detail``: the loop's ``select`` calls per Step and CPU in them
  layers    with ``--stream``: of loop-out, the CPU in a message's handler chain outside
            the handler (interceptors' wrappers, parse, guard, bounds, error mapping)

``--new-env KEY=VALUE``: environment of this checkout's server only (with ``--old HEAD``,
a setting or an environment variable against none).

The figures are medians over the rounds; "new-old" is the median of each round's
difference (paired). Block ids are checked equal across codes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()

_SERVE = "serve"
#: the file the serve mode writes its totals to on SIGUSR1
_OUT_ENV = "KVCOORD_SPLIT_OUT"
_DETAIL_ENV = "KVCOORD_SPLIT_LOOP_DETAIL"


def serve() -> None:
    """The server (child): ``kvcoord serve`` with Step, the collector and (optionally)
    the selector timed; totals written to $KVCOORD_SPLIT_OUT on SIGUSR1."""
    import selectors

    from kvcoord.service import servicer as S

    try:  # where the guard reads the bounds and the parser (servicer.py before its split)
        from kvcoord.service import rpc_guard as G
    except ImportError:
        G = S

    acc = {
        "handler": 0.0,
        "steps": 0,
        "bounds": 0.0,
        "parse": 0.0,
        "gc": 0.0,
        "gcs": 0,
        "select": 0.0,
        "selects": 0,
        "chain": 0.0,
    }
    step = S.AllocatorServicer.Step

    async def timed(self: Any, request: Any, context: Any) -> Any:
        t0 = time.thread_time()
        try:
            return await step(self, request, context)
        finally:
            acc["handler"] += time.thread_time() - t0
            acc["steps"] += 1

    S.AllocatorServicer.Step = timed  # type: ignore[method-assign]
    try:
        from kvcoord.service import step_stream as SS
    except ImportError:  # a tree from before StepStream
        SS = None
    if SS is not None:
        intercepted = SS._intercepted

        async def chain(
            interceptors: Any, handler: Any, details: Any
        ) -> Any:  # a message's whole chain, timed
            wrapped = await intercepted(interceptors, handler, details)
            inner = wrapped.unary_unary

            async def unary(data: bytes, context: Any) -> Any:
                t0 = time.thread_time()
                try:
                    return await inner(data, context)
                finally:
                    acc["chain"] += time.thread_time() - t0

            return wrapped._replace(unary_unary=unary)

        SS._intercepted = chain
    check = G.check_request_slices

    def checked(request: Any, limits: Any, every: int) -> Any:  # the input bounds, timed
        work = check(request, limits, every)
        while True:
            t0 = time.thread_time()
            try:
                next(work)
            except StopIteration:
                return
            finally:
                acc["bounds"] += time.thread_time() - t0
            yield

    G.check_request_slices = checked
    parse = G.parse_in_turns

    async def parsed(cls: Any, data: bytes, seconds: float, pause: float) -> Any:  # the request's parse
        t0 = time.thread_time()
        try:
            return await parse(cls, data, seconds, pause)
        finally:
            acc["parse"] += time.thread_time() - t0

    G.parse_in_turns = parsed
    main_thread = __import__("threading").get_ident()
    gc_t0 = [0.0]

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if __import__("threading").get_ident() != main_thread:
            return
        if phase == "start":
            gc_t0[0] = time.thread_time()
        else:
            acc["gc"] += time.thread_time() - gc_t0[0]
            acc["gcs"] += 1

    gc.callbacks.append(on_gc)
    if os.environ.get(_DETAIL_ENV):
        inner = selectors.DefaultSelector.select

        def select(self: Any, timeout: Any = None) -> Any:
            t0 = time.thread_time()
            try:
                return inner(self, timeout)
            finally:
                acc["select"] += time.thread_time() - t0
                acc["selects"] += 1

        selectors.DefaultSelector.select = select  # type: ignore[method-assign]

    def dump(_sig: int, _frame: Any) -> None:
        with open(os.environ[_OUT_ENV], "w", encoding="ascii") as f:
            json.dump(acc, f)

    signal.signal(signal.SIGUSR1, dump)
    from kvcoord.service.cli import main

    sys.argv = ["kvcoord", *sys.argv[2:]]
    main()


def _thread_ns(pid: int) -> int:
    """CPU of process ``pid``'s main thread (its event loop), ns."""
    with open(f"/proc/{pid}/task/{pid}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0])


def _totals(pid: int, path: Path) -> dict[str, float]:
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    for _ in range(500):  # bounded: the server writes it at its next bytecode
        if path.exists() and path.stat().st_size:
            try:
                return dict(json.loads(path.read_text()))
            except ValueError:
                pass
        time.sleep(0.01)
    raise RuntimeError(f"server {pid} wrote no totals")


def run_round(
    trees: dict[str, Path], trace: Path, args: argparse.Namespace, tmp: Path
) -> dict[str, dict[str, float | str]]:
    import decode_cpu as D
    import workers as W
    from kvcoord.client.testing import start_server
    from kvcoord.v1 import allocator_pb2 as pb

    bodies = D.load(trace)
    reqs = [D.shaped(pb, b, args.shape) for b in bodies]
    runs: dict[str, dict[str, Any]] = {}
    try:
        for code, tree in trees.items():
            out = tmp / f"{code}.json"
            env = dict(os.environ, PYTHONPATH=f"{tree / 'client'}:{tree / 'server'}", **{_OUT_ENV: str(out)})
            if args.loop_detail:
                env[_DETAIL_ENV] = "1"
            if code == "new":
                env.update(kv.split("=", 1) for kv in args.new_env)
            server = start_server(
                W.config_text("none", "", "FULL"), env=env, metrics=args.metrics,
                launcher=[sys.executable, str(HERE), _SERVE],
            )  # fmt: skip
            runs[code] = run = {"server": server, "out": out, "digest": hashlib.sha256()}
            D.open_session(run, server.address, args.running, step_stream=args.stream)
        order = list(runs.values())
        for k, ops in enumerate(reqs):
            if k == args.warmup:
                for run in order:
                    pid = run["server"].proc.pid
                    run["t0"] = _totals(pid, run["out"])
                    run["cpu0"], run["loop0"] = D.server_cpu(pid), _thread_ns(pid)
            for run in order if k % 2 else order[::-1]:
                att = run["att"]
                resp = run["client"].step("p", ops, att.session_id, att.fence)
                run["digest"].update(json.dumps(D.new_blocks(resp)).encode())
        for run in order:
            pid = run["server"].proc.pid
            run["cpu"] = D.server_cpu(pid) - run["cpu0"]
            run["loop"] = (_thread_ns(pid) - run["loop0"]) / 1e9
            t1 = _totals(pid, run["out"])
            run["d"] = {key: t1[key] - run["t0"][key] for key in t1}
            run["client"].detach(run["att"].session_id, run["att"].fence)
    finally:
        D.close_runs(runs)
    n = len(bodies) - args.warmup
    ops_n = sum(D.weight(b, pb) for b in bodies[args.warmup :])
    got: dict[str, dict[str, float | str]] = {}
    for code, run in runs.items():
        d = run["d"]
        assert d["steps"] == n, (d["steps"], n)
        got[code] = {
            "us_op": run["cpu"] / ops_n * 1e6,
            "total": run["cpu"] / n * 1e6,
            "handler": d["handler"] / n * 1e6,
            "loop_out": (run["loop"] - d["handler"]) / n * 1e6,
            "other": (run["cpu"] - run["loop"]) / n * 1e6,
            "gc": d["gc"] / n * 1e6,
            "bounds": d.get("bounds", 0.0) / n * 1e6,
            "parse": d.get("parse", 0.0) / n * 1e6,
            "gcs": d["gcs"] / n,
            "select": d["select"] / n * 1e6,
            "selects": d["selects"] / n,
            "layers": (d.get("chain", 0.0) - d["handler"]) / n * 1e6 if d.get("chain") else 0.0,
            "digest": run["digest"].hexdigest(),
        }
    return got


COLUMNS = (
    "us_op",
    "total",
    "handler",
    "loop_out",
    "other",
    "gc",
    "gcs",
    "bounds",
    "parse",
    "select",
    "selects",
    "layers",
)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == _SERVE:
        serve()
        return
    sys.path[:0] = [str(HERE.parent), str(ROOT / "client"), str(ROOT / "server")]
    import decode_cpu as D
    from common import old_tree

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=1000, help="measured Steps")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--old", help="a git revision to compare against (its client and server)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--metrics", action="store_true", help="the servers also serve /metrics")
    ap.add_argument("--loop-detail", action="store_true", help="count and time the loop's select calls")
    ap.add_argument("--stream", action="store_true", help="Steps on the client's StepStream (else unary)")
    ap.add_argument("--shape", choices=["columnar", "packed"], default="columnar", help="DecodeOps' columns")
    ap.add_argument(
        "--new-env", nargs="*", default=[], metavar="KEY=VALUE",
        help="environment of this checkout's server only (with --old HEAD: a setting against none)",
    )  # fmt: skip
    args = ap.parse_args()
    trees = {"new": ROOT} if not args.old else {"old": old_tree(args.old), "new": ROOT}
    tmp = Path(tempfile.mkdtemp(prefix="kvcoord-step-split-"))
    for running in args.running:
        args.running = running
        trace = tmp / f"trace{running}.bin"
        D.build(running, args.warmup + args.steps, trace)
        rows: dict[str, list[dict[str, Any]]] = {c: [] for c in trees}
        for rnd in range(args.rounds):
            got = run_round(trees, trace, args, tmp)
            for code, r in got.items():
                rows[code].append(r)
                print(
                    f"round {rnd + 1} running {running} {code}: "
                    + "  ".join(f"{c} {float(r[c]):.2f}" for c in COLUMNS),
                    flush=True,
                )
        D.print_table_head(
            f"{running} running, {args.steps} measured Steps, {'stream' if args.stream else 'unary'}, {args.shape}; medians over {args.rounds} round(s)",
            args.metrics,
            ["code", "µs/op", "µs/Step", "handler", "loop outside", "other threads", "gc (n)", "bounds", "parse",
             "select (n)", "layers"],
        )  # fmt: skip
        pairs = [(c, rows[c]) for c in trees]
        if args.old:
            diff = [
                {k: float(n[k]) - float(o[k]) for k in COLUMNS}
                for n, o in zip(rows["new"], rows["old"], strict=True)
            ]
            pairs.append(("new-old", diff))  # type: ignore[arg-type]
        for code, rs in pairs:
            med = {k: statistics.median(float(r[k]) for r in rs) for k in COLUMNS}
            print(
                f"| {code} | {med['us_op']:.2f} | {med['total']:.0f} | {med['handler']:.0f} | "
                f"{med['loop_out']:.0f} | {med['other']:.0f} | {med['gc']:.0f} ({med['gcs']:.2f}) | "
                f"{med['bounds']:.0f} | {med['parse']:.0f} | "
                f"{med['select']:.0f} ({med['selects']:.1f}) | {med['layers']:.0f} |"
            )
        digests = {r["digest"] for rs in rows.values() for r in rs}
        print(f"new block ids: {'the same' if len(digests) == 1 else 'DIFFERENT'} in every code and round\n")


if __name__ == "__main__":
    main()
