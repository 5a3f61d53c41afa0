"""Server CPU per block operation on decode-heavy Steps, in-process and over gRPC. Not a test.

    PYTHONPATH=client:server python bench/decode_cpu.py [--running 64] [--steps 300] \
        [--warmup 100] [--shapes ops run] [--old REV] [--rounds 3] \
        [--where in-process grpc grpc-stream] \
        [--metrics] [--profile | --toggle | --baseline REV] [--engine-build DIR]

The workload is bench/workers.py's (one worker's scheduler: ``--running`` requests in
decode, each step one allocation per running request, finished requests freed and
replaced by a prefilled new one), recorded once as a fixed list of Steps and replayed
against each server, so every code sees the same calls. Shapes:

  ops   what workers.py's batched mode sends: one AllocateOp (with its positioned
        RequestSync) per allocation, a FreeOp per finished request
  run   the same calls, the allocations of registered requests as one AllocateRunOp
        (columns; what the predicting client's sender sends to a server without DecodeOp)
  columnar  the same runs as one DecodeOp each (the same columns, refusable entries;
        what the predicting client sent to a server listing "decode_op" before the
        packed form), its columns repeated fields
  packed    the same DecodeOps with their columns packed (the ``packed_*`` fields: one
        bytes field per column; what the predicting client sends now). This checkout only

For each code (this checkout, and with ``--old REV`` that git revision's client and
server, ``git archive``d) and shape, in turns for ``--rounds`` rounds:

  in-process  a child process of that code runs an in-process server and applies the
              Steps on its event loop as gRPC's handler would: the request parsed from
              its bytes, ``Servicer.Step`` (session, idempotency key, the Step applied,
              its answer kept), the answer serialized (the kept bytes: code since
              fix-srv23 answers with them); CPU is the loop thread's
              (``time.thread_time``) over the measured Steps, and the cyclic
              collector's collections in them by generation (young / middle / full)
              with the loop thread's CPU in them per Step (``gc.callbacks``)
  grpc        a ``kvcoord serve`` process of each code, all at once (``--metrics``: each
              also serves /metrics, as ``kvcoord serve`` does by default; the metrics
              interceptor and observer run either way), one client (this checkout's)
              sending each Step to every server in turn, which goes first alternating,
              so that other jobs on the machine slow every code alike; CPU is each
              server process's (all its threads; Linux's process CPU clock, in ns) over
              the measured Steps, and the Step's latency as the client sees it (p50 / mean)
              and the client's CPU per Step (the benchmark process's, all its threads,
              over each call: gRPC's own threads included)
  grpc-stream the same, each Step sent on the client's StepStream (its default when
              the server lists "step_stream"; ``grpc`` sends unary Steps); with both,
              every Step goes to one server per code and transport in turn (paired),
              and a line gives the median per-round stream/unary ratio of server CPU

"µs/op" is CPU per block operation (each allocation and each free is one operation);
the table gives each code's median over the rounds and, with ``--old``, the median of
each round's new/old ratio (the two codes run one after the other in every round, so a
load that changes between rounds moves both).
Every allocation's new block ids are digested per shape and code: a line says whether
every code and shape answered the same blocks (they must). ``--profile``: the
in-process child of this checkout prints a cProfile of the loop thread instead.

``--baseline REV``: four servers at once, each sent every Step in turn: REV's with
unary Steps of runs (what a server without DecodeOp or StepStream served best: the code
at issue 23's filing is a2bf467), this checkout's the same way, and this checkout's with
streamed DecodeOps, columns repeated (columnar) and packed (what the predicting client
sends); each one's server CPU per operation and its median per-round ratio to REV's,
and the packed one's to the columnar one's (paired: the packed form's gain).

``--engine-build DIR``: DIR holds this checkout's engine compiled by mypyc (built by
``python bench/compile_engine.py DIR``), put first on the path of a code "compiled": this checkout
with that engine, measured beside "new" (this checkout, pure Python) wherever "new" is,
with the median of each round's compiled/new ratio (with ``--baseline``: two more
servers, compiled with unary runs and with streamed DecodeOps).

``--toggle`` (this checkout only, shape ops): one in-process server, two pools fed the
same Steps in alternation (which pool goes first alternates too), a plain decode
AllocateOp on the pool's direct path (``PoolAllocations.allocate_plain``) in one and on the
general path in the other (the wire reader's ``plain`` mark cleared); the loop
thread's CPU per Step of each, and the median of their per-Step ratio. On a machine
shared with other jobs this pairs every Step with its twin, where two runs apart can
differ by 20 %.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()

_BUILD = "build"
_CHILD = "child"
#: code name -> the compiled engine's build directory put first on its path (``--engine-build``)
ENGINE_BUILDS: dict[str, Path] = {}


def _paths(tree: Path, engine: str = "") -> None:
    sys.path[:0] = [
        *([engine] if engine else []),
        str(HERE.parent),
        str(tree / "client"),
        str(tree / "server"),
    ]


def code_path(code: str, tree: Path) -> str:
    """The PYTHONPATH of code ``code`` (its tree's client and server, after its compiled
    engine's build directory if it has one)."""
    build = ENGINE_BUILDS.get(code)
    return ":".join([*([str(build)] if build else []), str(tree / "client"), str(tree / "server")])


# ---------------------------------------------------------------------------
# the recorded workload (built with this checkout's protobuf classes, kept as bytes)


def build(running: int, steps: int, out: Path) -> None:
    """Record ``steps`` Steps of one workers.py worker (attached to a throwaway
    in-process server: the worker needs a session to exist) as length-prefixed
    serialized operation lists in ``out``."""
    import workers as W
    from kvcoord.client import KVCoordClient
    from kvcoord.service.testing import InProcessServer
    from kvcoord.v1 import allocator_pb2 as pb

    srv = InProcessServer(metrics=False).start()
    try:
        with KVCoordClient(srv.address, timeout=60) as c:
            c.create_pool("p", W.pool_config(W.worker_blocks(running)))
        w = W.Worker(0, srv.address, "p", running, seed=1)
        with out.open("wb") as f:
            for _ in range(steps):
                body = pb.StepRequest(ops=w.step_ops()).SerializeToString()
                f.write(len(body).to_bytes(4, "little") + body)
        w.client.close()
    finally:
        srv.stop()
    # what a child needs of workers.py, which it must not import (importing it puts
    # this checkout's client and server first on sys.path: an old tree's child would
    # then run this checkout's code)
    pool = {
        "config": W.pool_config(W.worker_blocks(running)).SerializeToString().hex(),
        "attach": [W.ALGO, W.BS, W.SEED],
    }
    out.with_suffix(".pool.json").write_text(json.dumps(pool))


def load(path: Path) -> list[bytes]:
    data = path.read_bytes()
    out, k = [], 0
    while k < len(data):
        n = int.from_bytes(data[k : k + 4], "little")
        out.append(data[k + 4 : k + 4 + n])
        k += 4 + n
    return out


def shaped(pb: Any, body: bytes, shape: str) -> list[Any]:
    """A recorded Step's operations in ``shape`` (a run holds the allocations of
    registered requests between two other operations: the order is kept)."""
    ops = list(pb.StepRequest.FromString(body).ops)
    if shape == "ops":
        return ops
    out: list[Any] = []
    run = None
    for o in ops:
        if o.HasField("allocate") and not o.allocate.request.new_request:
            if run is None:
                if shape in ("columnar", "packed"):
                    out.append(pb.Operation(decode=pb.DecodeOp()))
                    run = out[-1].decode
                else:
                    out.append(pb.Operation(allocate_run=pb.AllocateRunOp()))
                    run = out[-1].allocate_run
            s = o.allocate.request
            run.request_ids.append(s.request_id)
            run.base_num_tokens.append(s.base_num_tokens)
            run.base_num_hashes.append(s.base_num_hashes)
            run.num_computed_tokens.append(s.num_computed_tokens)
            run.num_new_tokens.append(o.allocate.num_new_tokens)
            run.num_lookahead_tokens.append(o.allocate.num_lookahead_tokens)
            run.num_append_tokens.append(len(s.append_token_ids))
            run.append_token_ids.extend(s.append_token_ids)
            run.num_append_hashes.append(len(s.append_block_hashes))
            run.append_block_hashes.extend(s.append_block_hashes)
        else:
            out.append(o)
            run = None
    if shape == "packed":
        from kvcoord.wire.columns import write_packed_decode

        for o in out:
            if o.HasField("decode"):
                columns = _Columns(o.decode)
                o.decode.Clear()
                write_packed_decode(o.decode, columns)
    return out


class _Columns:
    """A repeated-form DecodeOp's columns, written as the client's ColumnRun writes its
    own (for :func:`~kvcoord.wire.write_packed_decode`)."""

    def __init__(self, d: Any) -> None:
        self.values = [(f.name, list(v)) for f, v in d.ListFields() if f.name != "must_succeed"]

    def write(self, into: Any) -> None:
        for name, values in self.values:
            getattr(into, name).extend(values)


def weight(body: bytes, pb: Any) -> int:
    return len(pb.StepRequest.FromString(body).ops)


def new_blocks(resp: Any) -> list[list[int]]:
    """Each allocation's new block ids (all groups, flattened), in the Step's order."""
    out: list[list[int]] = []
    for r in resp.results:
        if r.status_code:
            raise RuntimeError(f"operation failed: {r.status_code} {r.status_message}")
        if r.HasField("allocate"):
            if r.allocate.refused or r.allocate.stale_hit:
                raise RuntimeError("allocation refused: the pool is too small")
            out.append([b for g in r.allocate.new_block_ids for b in g.block_ids])
        elif r.HasField("allocate_run"):
            ids = list(r.allocate_run.new_block_ids)
            k = 0
            for n in r.allocate_run.num_new_blocks:  # one group per entry (full attention)
                out.append(ids[k : k + n])
                k += n
        elif r.HasField("decode"):
            if r.decode.refused:
                raise RuntimeError("allocation refused: the pool is too small")
            ids = list(r.decode.new_block_ids)
            k = 0
            for n in r.decode.num_new_blocks:  # one group per entry (full attention)
                out.append(ids[k : k + n])
                k += n
    return out


# ---------------------------------------------------------------------------
# in-process (a child of the code measured)


def child(trace: Path, shape: str, warmup: int, running: int, profile: bool) -> dict[str, Any]:
    import asyncio  # noqa: F401
    import cProfile
    import gc
    import pstats

    from kvcoord.client import KVCoordClient
    from kvcoord.service.testing import InProcessServer
    from kvcoord.v1 import allocator_pb2 as pb

    bodies = load(trace)
    pool = json.loads(trace.with_suffix(".pool.json").read_text())
    config = pb.PoolConfig.FromString(bytes.fromhex(pool["config"]))
    srv = InProcessServer(metrics=False).start()
    servicer = srv.running.servicer  # type: ignore[union-attr]
    digest = hashlib.sha256()
    try:
        with KVCoordClient(srv.address, timeout=60) as c:
            c.create_pool("p", config)
            att = c.attach("p", *pool["attach"], "bench")
            wire = []
            for k, b in enumerate(bodies):
                req = pb.StepRequest(
                    pool="p", session_id=att.session_id, ops=shaped(pb, b, shape), idempotency_key=f"k{k}"
                )
                wire.append(req.SerializeToString())
            ops = sum(weight(b, pb) for b in bodies[warmup:])
            prof = cProfile.Profile() if profile else None

            collections = [0, 0, 0]
            in_gc = [0.0, 0.0]  # (CPU in the collector, its start)

            def collected(phase: str, info: dict[str, int]) -> None:
                if threading.get_ident() != loop_thread:
                    return
                if phase == "start":
                    in_gc[1] = time.thread_time()
                else:
                    collections[info["generation"]] += 1
                    in_gc[0] += time.thread_time() - in_gc[1]

            async def run(part: list[bytes], timed: bool) -> tuple[float, list[bytes]]:
                answers = []
                if prof is not None and timed:
                    prof.enable()
                if timed:
                    gc.callbacks.append(collected)
                t0 = time.thread_time()
                for body in part:
                    resp = await servicer.Step(pb.StepRequest.FromString(body), None)
                    answers.append(resp if type(resp) is bytes else resp.SerializeToString())
                cpu = time.thread_time() - t0
                if timed:
                    gc.callbacks.remove(collected)
                if prof is not None and timed:
                    prof.disable()
                return cpu, answers

            loop_thread = srv._run(_thread_ident(), 60)
            _, warm = srv._run(run(wire[:warmup], False), 600)
            cpu, timed = srv._run(run(wire[warmup:], True), 600)
            for a in warm + timed:
                blocks = new_blocks(pb.StepResponse.FromString(a))
                digest.update(json.dumps(blocks).encode())
            c.detach(att.session_id, att.fence)
    finally:
        srv.stop()
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(35)
    return {
        "us_op": cpu / ops * 1e6,
        "ms_step": cpu / len(bodies[warmup:]) * 1e3,
        "digest": digest.hexdigest(),
        "gc": collections,
        "gc_ms_step": in_gc[0] / len(bodies[warmup:]) * 1e3,
    }


async def _thread_ident() -> int:
    """The thread running the event loop (the in-process server's)."""
    return threading.get_ident()


def toggle(trace: Path, warmup: int, running: int) -> None:
    """``--toggle``: see the module's docstring."""
    import workers as W
    from kvcoord.client import KVCoordClient
    from kvcoord.service import mutating_calls
    from kvcoord.service import operations as op
    from kvcoord.service.testing import InProcessServer
    from kvcoord.v1 import allocator_pb2 as pb

    bodies = load(trace)
    read = mutating_calls.operation_from_pb
    general = {"on": False}

    def reader(o: Any, groups: int) -> Any:  # the same wrapper on both sides
        value = read(o, groups)
        if general["on"] and type(value) is op.Allocate:
            value.plain = False
        return value

    mutating_calls.operation_from_pb = reader  # type: ignore[assignment]
    srv = InProcessServer(metrics=False).start()
    servicer = srv.running.servicer  # type: ignore[union-attr]
    cpu: dict[str, list[float]] = {"direct": [], "general": []}
    answers: dict[str, list[bytes]] = {"direct": [], "general": []}
    try:
        with KVCoordClient(srv.address, timeout=60) as c:
            wire: dict[str, list[bytes]] = {}
            for name in cpu:
                c.create_pool(name, W.pool_config(W.worker_blocks(running)))
                att = c.attach(name, W.ALGO, W.BS, W.SEED, "bench")
                wire[name] = [
                    pb.StepRequest(pool=name, session_id=att.session_id, ops=shaped(pb, b, "ops"),
                                   idempotency_key=f"k{k}").SerializeToString()
                    for k, b in enumerate(bodies)
                ]  # fmt: skip

            async def run() -> None:
                for k in range(len(bodies)):
                    for name in ("direct", "general") if k % 2 else ("general", "direct"):
                        general["on"] = name == "general"
                        t0 = time.thread_time()
                        resp = await servicer.Step(pb.StepRequest.FromString(wire[name][k]), None)
                        answers[name].append(resp if type(resp) is bytes else resp.SerializeToString())
                        cpu[name].append(time.thread_time() - t0)

            srv._run(run(), 900)
    finally:
        srv.stop()
    same = [new_blocks(pb.StepResponse.FromString(a)) for a in answers["direct"]] == [
        new_blocks(pb.StepResponse.FromString(a)) for a in answers["general"]
    ]
    n = [weight(b, pb) for b in bodies[warmup:]]
    print(
        f"{running} running, {len(n)} measured Steps, each applied to both pools in turns (loop thread CPU):\n"
    )
    print("| path | µs CPU per op (mean) | ms per Step (median) |")
    print("| --- | ---: | ---: |")
    for name, xs in cpu.items():
        xs = xs[warmup:]
        print(f"| {name} | {sum(xs) / sum(n) * 1e6:.2f} | {statistics.median(xs) * 1e3:.3f} |")
    ratios = [d / g for d, g in zip(cpu["direct"][warmup:], cpu["general"][warmup:], strict=True) if g]
    print(f"\ndirect / general, median per Step: {statistics.median(ratios):.3f}")
    print(f"new block ids: {'the same' if same else 'DIFFERENT'} on both paths")


def in_process(
    tree: Path, trace: Path, shape: str, args: argparse.Namespace, profile: bool, code: str = "new"
) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH="")
    cmd = [
        sys.executable,
        str(HERE),
        _CHILD,
        str(tree),
        str(trace),
        shape,
        str(args.warmup),
        str(args.running),
    ]
    if profile:
        cmd.append("--profile")
    if code in ENGINE_BUILDS:
        cmd += ["--engine", str(ENGINE_BUILDS[code])]
    out = subprocess.run(cmd, env=env, check=True, capture_output=not profile, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1])) if out else {}


# ---------------------------------------------------------------------------
# over gRPC (a server process of the code measured; this checkout's client)


def server_cpu(pid: int) -> float:
    """Seconds of CPU process ``pid`` has used (all its threads): Linux's CPU clock of
    another process (nanoseconds), else ``/proc`` (clock ticks, 10 ms)."""
    try:
        return time.clock_gettime_ns((~pid << 3) | 2) / 1e9  # CPUCLOCK_SCHED of the process
    except OSError:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_session(run: dict[str, Any], address: str, running: int, **client: Any) -> None:
    """Into ``run``: a client of the server at ``address`` (``client``: its options), pool
    "p" made there for ``running`` requests, and a session on it (``run["att"]``)."""
    import workers as W
    from kvcoord.client import KVCoordClient

    run["client"] = c = KVCoordClient(address, timeout=60, **client)
    c.create_pool("p", W.pool_config(W.worker_blocks(running)))
    run["att"] = c.attach("p", W.ALGO, W.BS, W.SEED, "bench")


def close_runs(runs: dict[Any, dict[str, Any]]) -> None:
    """Close every run's client and stop its server."""
    for run in runs.values():
        if "client" in run:
            run["client"].close()
        run["server"].stop()


def print_table_head(title: str, metrics: bool, columns: list[str], text_columns: int = 1) -> None:
    """A results table's title (with /metrics and the load average) and its header: the
    first ``text_columns`` columns left-aligned, the rest numbers."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{title}; /metrics {'served' if metrics else 'off'}; load average {load}:\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * text_columns + " ---: |" * (len(columns) - text_columns))


def over_grpc(
    trees: dict[str, Path], trace: Path, shape: str, args: argparse.Namespace, wheres: list[str]
) -> dict[tuple[str, str], dict[str, Any]]:
    """One ``kvcoord serve`` process per code and transport (``wheres``: grpc, unary
    Steps; grpc-stream, Steps on a StepStream), all serving at once; each Step is sent
    to every server in turn (which goes first alternates), so a machine shared with
    other jobs slows every code alike. Returns each (where, code)'s figures."""
    runs = [(where, code, tree, shape) for where in wheres for code, tree in trees.items()]
    return {(where, code): r for (where, code, _), r in served(runs, trace, args).items()}


def served(
    runs_of: list[tuple[str, str, Path, str]], trace: Path, args: argparse.Namespace
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """:func:`over_grpc` for any list of (where, code, tree, shape): each server is sent
    the recorded Steps in its own shape. Returns each (where, code, shape)'s figures."""
    import workers as W
    from kvcoord.client.testing import start_server
    from kvcoord.v1 import allocator_pb2 as pb

    bodies = load(trace)
    by_shape = {shape: [shaped(pb, b, shape) for b in bodies] for *_, shape in runs_of}
    runs: dict[tuple[str, str, str], dict[str, Any]] = {}
    try:
        for where, code, tree, shape in runs_of:
            env = dict(os.environ, PYTHONPATH=code_path(code, tree))
            # memory only; the metrics interceptor and observer run either way, --metrics
            # also serves /metrics (as `kvcoord serve` does by default)
            server = start_server(W.config_text("none", "", "FULL"), env=env, metrics=args.metrics)
            runs[(where, code, shape)] = run = {
                "server": server, "lat": [], "cli": [], "digest": hashlib.sha256(), "reqs": by_shape[shape]
            }  # fmt: skip
            open_session(run, server.address, args.running, step_stream=where == "grpc-stream")
        order = list(runs.values())
        for k in range(len(bodies)):
            if k == args.warmup:
                for run in order:
                    run["cpu0"] = server_cpu(run["server"].proc.pid)
            for run in order if k % 2 else order[::-1]:
                att = run["att"]
                c0, t0 = time.process_time(), time.perf_counter()
                resp = run["client"].step("p", run["reqs"][k], att.session_id, att.fence)
                run["lat"].append(time.perf_counter() - t0)
                run["cli"].append(time.process_time() - c0)
                run["digest"].update(json.dumps(new_blocks(resp)).encode())
        for run in order:
            run["cpu"] = server_cpu(run["server"].proc.pid) - run["cpu0"]
            run["client"].detach(run["att"].session_id, run["att"].fence)
    finally:
        close_runs(runs)
    ops_n = sum(weight(b, pb) for b in bodies[args.warmup :])
    out = {}
    for key, run in runs.items():
        lat = run["lat"][args.warmup :]
        out[key] = {
            "us_op": run["cpu"] / ops_n * 1e6,
            "p50": statistics.median(lat) * 1e3,
            "mean": statistics.fmean(lat) * 1e3,
            "client_ms": statistics.fmean(run["cli"][args.warmup :]) * 1e3,
            "digest": run["digest"].hexdigest(),
        }
    return out


def baseline(old: Path, trace: Path, args: argparse.Namespace) -> None:
    """``--baseline REV``: in every round, three servers at once, each sent every recorded
    Step in turn: REV's (unary Steps, allocations as runs: what a server without DecodeOp
    or StepStream served best), this checkout's the same way, and this checkout's with
    the Steps streamed as DecodeOps (what the predicting client sends it). Prints each
    one's server CPU per operation and its median per-round ratio to REV's."""
    runs = [
        ("grpc", "base", old, "run"),
        ("grpc", "new", ROOT, "run"),
        ("grpc-stream", "new", ROOT, "columnar"),
        ("grpc-stream", "new", ROOT, "packed"),
        *((where, code, ROOT, shape) for code in ENGINE_BUILDS for where, _, _, shape in
          [("grpc", "", "", "run"), ("grpc-stream", "", "", "packed")]),
    ]  # fmt: skip
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        if args.alone:  # one server at a time, the order reversed every other round
            got = {
                k: v
                for run in (runs if rnd % 2 == 0 else runs[::-1])
                for k, v in served([run], trace, args).items()
            }
        else:
            got = served(runs, trace, args)
        for key, r in got.items():
            rows.setdefault(key, []).append(r)
            print(
                f"round {rnd + 1} {' '.join(key):28} {r['us_op']:6.2f} µs/op  p50 {r['p50']:.2f} ms",
                flush=True,
            )
    print_table_head(
        f"{args.running} running, {args.steps} measured Steps (medians over {args.rounds} round(s)), "
        f"base {args.baseline}",
        args.metrics,
        ["where", "code", "shape", "µs CPU/op", "x base (paired)", "p50 ms", "mean ms"],
        text_columns=3,
    )
    base = rows[("grpc", "base", "run")]
    for key, rs in rows.items():
        ratio = statistics.median(r["us_op"] / b["us_op"] for r, b in zip(rs, base, strict=True))
        print(
            f"| {' | '.join(key)} | {statistics.median(r['us_op'] for r in rs):.2f} | {ratio:.2f} | "
            f"{statistics.median(r['p50'] for r in rs):.2f} | {statistics.median(r['mean'] for r in rs):.2f} |"
        )
    pairs = zip(rows[("grpc-stream", "new", "packed")], rows[("grpc-stream", "new", "columnar")], strict=True)
    ratio = statistics.median(p["us_op"] / c["us_op"] for p, c in pairs)
    print(f"\ngrpc-stream new: packed/columnar server CPU per op (paired, median per round) {ratio:.3f}")
    for code in ENGINE_BUILDS:
        for where, shape in (("grpc", "run"), ("grpc-stream", "packed")):
            pairs = zip(rows[(where, code, shape)], rows[(where, "new", shape)], strict=True)
            ratio = statistics.median(c["us_op"] / n["us_op"] for c, n in pairs)
            print(f"{where} {shape}: {code}/new server CPU per op (paired, median per round) {ratio:.2f}")
    same = len({r["digest"] for rs in rows.values() for r in rs}) == 1
    print(f"\nnew block ids: {'the same' if same else 'DIFFERENT'} in every code, shape and place")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        tree, trace, shape, warmup, running = sys.argv[2:7]
        engine = sys.argv[sys.argv.index("--engine") + 1] if "--engine" in sys.argv else ""
        _paths(Path(tree), engine)
        res = child(Path(trace), shape, int(warmup), int(running), "--profile" in sys.argv)
        import kvcoord.engine.pool
        import kvcoord.service.pool_service

        for module, home in ((kvcoord.engine.pool, engine or tree), (kvcoord.service.pool_service, tree)):
            # the code meant, no other
            assert Path(str(module.__file__)).resolve().is_relative_to(Path(home).resolve()), module.__file__
        print(json.dumps(res))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=64, help="running requests (allocations per Step)")
    ap.add_argument("--steps", type=int, default=300, help="measured Steps")
    ap.add_argument("--warmup", type=int, default=100, help="Steps applied before measuring")
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=["ops", "run", "columnar"],
        choices=["ops", "run", "columnar", "packed"],
    )
    ap.add_argument("--old", help="a git revision to compare against (its client and server)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--where", nargs="+", default=["in-process", "grpc"], choices=["in-process", "grpc", "grpc-stream"]
    )
    ap.add_argument("--profile", action="store_true", help="cProfile this checkout's in-process child")
    ap.add_argument(
        "--metrics",
        action="store_true",
        help="grpc: the servers also serve /metrics (the default of kvcoord serve)",
    )
    ap.add_argument("--toggle", action="store_true", help="the direct path against the general one, in turns")
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="REV's server sent unary Steps of runs (what it served best) against this checkout's, "
        "unary runs and streamed DecodeOps, paired Step by Step",
    )
    ap.add_argument(
        "--alone",
        action="store_true",
        help="with --baseline: each server runs by itself (the others not started), one after "
        "the other, the order reversed every other round, instead of all at once sent each Step in turn",
    )
    ap.add_argument(
        "--engine-build",
        metavar="DIR",
        type=Path,
        help="this checkout with the compiled engine built in DIR, measured as code 'compiled'",
    )
    args = ap.parse_args()
    if args.engine_build:
        ENGINE_BUILDS["compiled"] = args.engine_build.resolve()
    _paths(ROOT)
    from common import old_tree

    tmp = Path(tempfile.mkdtemp(prefix="kvcoord-decode-cpu-"))
    trace = tmp / "trace.bin"
    build(args.running, args.warmup + args.steps, trace)
    if args.toggle:
        toggle(trace, args.warmup, args.running)
        return
    if args.profile:
        for shape in args.shapes:
            print(f"--- {shape}", flush=True)
            in_process(ROOT, trace, shape, args, True)
        return
    if args.baseline:
        baseline(old_tree(args.baseline), trace, args)
        return
    trees = {"new": ROOT} if not args.old else {"old": old_tree(args.old), "new": ROOT}
    trees.update({code: ROOT for code in ENGINE_BUILDS})
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    grpc_wheres = [w for w in args.where if w.startswith("grpc")]
    for rnd in range(args.rounds):
        for where in args.where:
            if where.startswith("grpc") and where != grpc_wheres[0]:
                continue  # (measured with the first, paired)
            for shape in args.shapes:
                if where.startswith("grpc"):
                    got = over_grpc(trees, trace, shape, args, grpc_wheres)
                else:
                    got = {
                        (where, code): in_process(tree, trace, shape, args, False, code)
                        for code, tree in trees.items()
                    }
                for (w, code), r in got.items():
                    rows.setdefault((w, shape, code), []).append(r)
                    extra = (
                        f"  p50 {r['p50']:.2f} ms  mean {r['mean']:.2f} ms  client {r['client_ms']:.3f} ms CPU/Step"
                        if "p50" in r
                        else ""
                    )
                    if "gc" in r:
                        extra += "  gc {} collections, {:.3f} ms CPU/Step".format(
                            " / ".join(map(str, r["gc"])), r["gc_ms_step"]
                        )
                    print(
                        f"round {rnd + 1} {w:11} {shape:4} {code}: {r['us_op']:6.2f} µs/op{extra}",
                        flush=True,
                    )
    print_table_head(
        f"{args.running} running, {args.steps} measured Steps (medians over {args.rounds} round(s))",
        args.metrics,
        ["where", "shape", *(f"{c} µs CPU/op" for c in trees), "new/old (paired)", "p50 ms", "mean ms",
         "client ms CPU/Step"],
        text_columns=2,
    )  # fmt: skip
    for where in args.where:
        for shape in args.shapes:
            med = {c: statistics.median(r["us_op"] for r in rows[(where, shape, c)]) for c in trees}
            # paired: each round's new against the same round's old (run one after the
            # other), so a load that changes between rounds moves both
            ratio = (
                f"{statistics.median(n['us_op'] / o['us_op'] for n, o in zip(rows[(where, shape, 'new')], rows[(where, shape, 'old')], strict=True)):.2f}"
                if "old" in med
                else "-"
            )
            lat = ""
            if where.startswith("grpc"):
                lat = " / ".join(
                    f"{statistics.median(r['p50'] for r in rows[(where, shape, c)]):.2f}" for c in trees
                )
                lat += " | " + " / ".join(
                    f"{statistics.median(r['mean'] for r in rows[(where, shape, c)]):.2f}" for c in trees
                )
                lat += " | " + " / ".join(
                    f"{statistics.median(r['client_ms'] for r in rows[(where, shape, c)]):.3f}" for c in trees
                )
            else:
                lat = "- | - | -"
            print(
                f"| {where} | {shape} | "
                + " | ".join(f"{med[c]:.2f}" for c in trees)
                + f" | {ratio} | {lat} |"
            )
    for code in ENGINE_BUILDS:
        for where in args.where:
            for shape in args.shapes:
                pairs = zip(rows[(where, shape, code)], rows[(where, shape, "new")], strict=True)
                print(
                    f"{where} {shape}: {code}/new server CPU per op (paired, median per round) "
                    f"{statistics.median(c['us_op'] / n['us_op'] for c, n in pairs):.2f}"
                )
    if {"grpc", "grpc-stream"} <= set(args.where):
        for shape in args.shapes:
            for c in trees:
                pairs = zip(rows[("grpc-stream", shape, c)], rows[("grpc", shape, c)], strict=True)
                print(
                    f"{shape} {c}: server CPU stream/unary (paired, median per round) "
                    f"{statistics.median(s['us_op'] / u['us_op'] for s, u in pairs):.2f}; client CPU "
                    f"{statistics.median(r['client_ms'] for r in rows[('grpc-stream', shape, c)]):.3f} / "
                    f"{statistics.median(r['client_ms'] for r in rows[('grpc', shape, c)]):.3f} ms per Step"
                )
    digests = {r["digest"] for rs in rows.values() for r in rs}
    if len(digests) > 1:
        for key, rs in rows.items():
            print(key, [r["digest"][:12] for r in rs])
    print(
        f"\nnew block ids: {'the same' if len(digests) == 1 else 'DIFFERENT'} in every code, shape and place"
    )


if __name__ == "__main__":
    main()
