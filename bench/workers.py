"""Many workers on one server: batched Steps against one Allocate RPC per operation. Not a test.

    PYTHONPATH=client:server python bench/workers.py [--workers 8] [--running 64] \
        [--seconds 5] [--warmup 1.5] [--pools own shared] [--durability none journal] \
        [--journal-sync FULL] [--modes batched unary] [--old REV [--rounds 3]]

One ``kvcoord serve`` process on loopback per durability mode ("none": memory only, so
that the journal does not dominate; "journal": a data_dir in a temporary directory with
``--journal-sync``), metrics off, log level WARNING. Against it, ``--workers`` worker
processes (multiprocessing, spawn), each its own client and session, each keeping
``--running`` requests in decode: every scheduler step appends one sampled token to
every running request and allocates one slot for it (positioned sync: ``base_num_tokens``
/ ``base_num_hashes``, the new token, the hash of the block it completed if any, the
computed-token count). A request that reaches its output length (64-256 tokens, the
first generation staggered) is freed and replaced by a new one (prompt 128-1,024
random tokens, prefilled in one allocation). Full attention, 16-token blocks, prefix
caching on (sha256_cbor hashes computed in the workers); pools sized so that nothing
is ever refused.

  batched   one ``Step`` per scheduler step carrying that step's operations (~64
            allocations, plus the occasional free and prefill)
  unary     the same operations, one ``Allocate`` (or ``Free``) RPC each

``--pools own``: each worker has its own pool; ``shared``: all attach to one pool.
Each phase: workers connect, attach and warm up for ``--warmup`` s, then all start
together (a barrier with this process) and run for ``--seconds``; the server's CPU time
(utime + stime from ``/proc/<pid>/stat``) is read at both barriers. Reported per mode,
summed over workers: operations/s, calls/s, p50/p99 latency per call (Step or
Allocate/Free, as the worker sees it), server CPU µs per operation and cores used,
workers' CPU µs per operation, and the machine's busy fraction; then batched/unary.
Workers and server share the machine's cores (say how many: they bound every figure).

``--old REV``: a second server runs the code of git revision REV (its client and server
sources, ``git archive``d to a temporary directory) beside this checkout's, and each
phase runs ``--rounds`` times on each server in turns (old, new, old, new, ...), so a
machine whose speed drifts slows both alike; a row per round and code, then the
medians and new/old of the server CPU per operation. The workers always run this
checkout's client.

``--engine-split``: the server also serves /metrics (scraped once at each barrier,
inside the measured time) and a line under each batched row splits its server CPU per
operation: the engine's work (``kvcoord_step_engine_seconds_sum`` over
``kvcoord_step_operations_total``: applying the Step's operations) and the rest (gRPC,
decoding and building messages, the journal, the event loop).

bench/replicas.py runs the same workers against a replica set (``run_phase``: an
address list and the replica pids; ``WorkerProcs``: spawning and gathering workers).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from common import old_tree  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.hashing import BlockHasher, none_hash  # noqa: E402
from kvcoord.client.testing import ServerProcess, start_server  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

BS = 16
ALGO = "sha256_cbor"
SEED = "0"
PROMPT = (128, 1024)
OUTPUT = (64, 256)
BARRIER_TIMEOUT = 180.0


# ---------------------------------------------------------------------------
# worker side


class Req:
    """One running request as the worker's scheduler sees it."""

    __slots__ = ("rid", "hasher", "num_tokens", "num_hashes", "left", "fresh", "prompt")

    def __init__(self, rid: str, prompt: list[int], outputs: int, none: bytes) -> None:
        self.rid = rid
        self.hasher = BlockHasher(ALGO, BS, none)
        self.num_tokens = 0  # tokens the server holds
        self.num_hashes = 0
        self.left = outputs  # decode steps before it finishes
        self.fresh = True
        self.prompt = prompt


class Worker:
    def __init__(
        self, idx: int, address: str, pool: str, running: int, seed: int, interceptors: tuple[Any, ...] = ()
    ) -> None:
        self.idx = idx
        self.pool = pool
        # ``address``: one server, or a replica set (comma-separated): calls follow NOT_OWNER
        self.client = KVCoordClient(address, timeout=60, interceptors=interceptors)
        att = self.client.attach(pool, ALGO, BS, SEED, f"worker-{idx}")
        self.session, self.fence = att.session_id, att.fence
        self.rnd = random.Random(seed)
        self.none = none_hash(ALGO, SEED)
        self.counter = 0
        self.known: set[str] = set()  # requests the server holds (to free at the end)
        self.backlog: list[pb.Operation] = []  # unary: the rest of a step cut by a deadline
        # the first generation finishes at staggered steps
        self.reqs = [self._new(self.rnd.randint(1, OUTPUT[1])) for _ in range(running)]

    def _new(self, outputs: int | None = None) -> Req:
        self.counter += 1
        prompt = [self.rnd.randrange(32000) for _ in range(self.rnd.randint(*PROMPT))]
        if outputs is None:
            outputs = self.rnd.randint(*OUTPUT)
        return Req(f"w{self.idx}-r{self.counter}", prompt, outputs, self.none)

    def _allocate(self, r: Req) -> pb.Operation:
        """The next allocation of ``r``: its prefill, or one decode token."""
        if r.fresh:
            sync = pb.RequestSync(
                request_id=r.rid,
                new_request=True,
                append_token_ids=r.prompt,
                append_block_hashes=r.hasher.extend(r.prompt),
            )
            n = len(r.prompt)
            r.fresh = False
            r.prompt = []
        else:
            tok = self.rnd.randrange(32000)  # the token sampled last step
            sync = pb.RequestSync(
                request_id=r.rid,
                base_num_tokens=r.num_tokens,
                base_num_hashes=r.num_hashes,
                append_token_ids=[tok],
                append_block_hashes=r.hasher.extend([tok]),
                num_computed_tokens=r.num_tokens,
            )
            n = 1
            r.left -= 1
        r.num_tokens += len(sync.append_token_ids)
        r.num_hashes += len(sync.append_block_hashes)
        return pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=n))

    def step_ops(self) -> list[pb.Operation]:
        """One scheduler step: finished requests freed and replaced, then one
        allocation per running request."""
        ops: list[pb.Operation] = []
        for i, r in enumerate(self.reqs):
            if r.left <= 0:
                ops.append(pb.Operation(free=pb.FreeOp(request_id=r.rid)))
                self.reqs[i] = self._new()
        ops.extend(self._allocate(r) for r in self.reqs)
        return ops

    @staticmethod
    def _check(res: Any) -> None:
        if res.status_code != 0:
            raise RuntimeError(f"operation failed: {res.status_code} {res.reason} {res.status_message}")
        if res.HasField("allocate") and (res.allocate.refused or res.allocate.stale_hit):
            raise RuntimeError("allocation refused: the pool is too small for the workload")

    def _applied(self, op: pb.Operation) -> None:
        if op.HasField("free"):
            self.known.discard(op.free.request_id)
        elif op.allocate.request.new_request:
            self.known.add(op.allocate.request.request_id)

    def run(self, mode: str, deadline: float, lat: list[float] | None) -> int:
        """Scheduler steps until ``deadline``; returns the operations applied."""
        ops_done = 0
        while time.perf_counter() < deadline:
            ops = self.backlog or self.step_ops()
            if mode == "batched":
                t0 = time.perf_counter()
                resp = self.client.step(self.pool, ops, self.session, self.fence)
                t1 = time.perf_counter()
                for op, res in zip(ops, resp.results, strict=True):
                    self._check(res)
                    self._applied(op)
                ops_done += len(ops)
                if lat is not None:
                    lat.append(t1 - t0)
                continue
            self.backlog = []
            for k, op in enumerate(ops):
                if time.perf_counter() >= deadline:
                    self.backlog = ops[k:]  # sent first by the next run
                    return ops_done
                t0 = time.perf_counter()
                if op.HasField("free"):
                    self.client.free(
                        self.pool, [op.free.request_id], session_id=self.session, fence=self.fence
                    )
                else:
                    resp = self.client.allocate(self.pool, op.allocate, self.session, self.fence)
                    if resp.result.refused or resp.result.stale_hit:
                        raise RuntimeError("allocation refused: the pool is too small for the workload")
                t1 = time.perf_counter()
                self._applied(op)
                ops_done += 1
                if lat is not None:
                    lat.append(t1 - t0)
        return ops_done

    def close(self) -> None:
        if self.known:
            self.client.free(self.pool, sorted(self.known), session_id=self.session, fence=self.fence)
        self.client.detach(self.session, self.fence)
        self.client.close()


def worker_main(
    idx: int,
    address: str,
    pool: str,
    mode: str,
    running: int,
    warmup: float,
    seconds: float,
    barrier: Any,
    results: Any,
) -> None:
    try:
        w = Worker(idx, address, pool, running, seed=1000 + idx)
        w.run(mode, time.perf_counter() + warmup, None)
        barrier.wait(BARRIER_TIMEOUT)  # all start together
        lat: list[float] = []
        c0 = os.times()
        t0 = time.perf_counter()
        ops = w.run(mode, t0 + seconds, lat)
        c1 = os.times()
        barrier.wait(BARRIER_TIMEOUT)  # all stopped: the server's CPU is read
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        w.close()
        results.put((idx, None, ops, lat, cpu))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()
        results.put((idx, f"{type(exc).__name__}: {exc}", 0, [], 0.0))


# ---------------------------------------------------------------------------
# parent side


def server_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds, from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


def pool_config(num_blocks: int) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))],
        hash_block_size=BS,
        enable_caching=True,
        enable_kv_cache_events=True,
        hash_algo=ALGO,
        hash_seed=SEED,
        max_model_len=1 << 16,
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else float("nan")


def engine_totals(server: ServerProcess) -> tuple[float, float]:
    """(engine seconds, operations) of every Step so far, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10) as answer:  # noqa: S310
        text = answer.read().decode()
    seconds = ops = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvcoord_step_engine_seconds_sum":
                seconds += sample.value
            elif sample.name == "kvcoord_step_operations_total":
                ops += sample.value
    return seconds, ops


class WorkerProcs:
    """``count`` worker processes (spawn), worker ``i`` running ``target(i, *args_of(i),
    barrier, results)``: it meets this process at :attr:`barrier` and puts one report
    ``(i, error or None, ...)`` on :attr:`results`."""

    def __init__(
        self, target: Callable[..., None], count: int, args_of: Callable[[int], tuple[Any, ...]]
    ) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(count + 1)
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=target,
                name=f"worker-{i}",
                daemon=True,
                args=(i, *args_of(i), self.barrier, self.results),
            )
            for i in range(count)
        ]
        for p in self.procs:
            p.start()

    def gather(self, seconds: float, broken: BaseException | None = None) -> list[Any]:
        """Every worker's report, in worker order, waiting at most ``seconds``.

        Raises:
            RuntimeError: a worker reported an error, or did not report.
        """
        got: list[Any] = []
        deadline = time.monotonic() + seconds
        while len(got) < len(self.procs) and time.monotonic() < deadline:
            try:
                got.append(self.results.get(timeout=1))
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs) and self.results.empty():
                    break
        errors = [f"worker {i}: {err}" for i, err, *_ in got if err]
        if broken or errors or len(got) < len(self.procs):
            raise RuntimeError(
                "; ".join(errors) or f"{len(got)} of {len(self.procs)} workers reported"
            ) from broken
        return sorted(got, key=lambda g: g[0])

    def reap(self) -> None:
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)


def worker_blocks(running: int) -> int:
    """Blocks a worker can hold at once (longest prompt + longest output, every request)."""
    return running * ((PROMPT[1] + OUTPUT[1]) // BS + 2) + 64


def phase(server: ServerProcess, layout: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One measured phase on one server: fresh pools, ``args.workers`` processes, one mode."""
    if layout == "own":
        pools = [f"{mode}-w{i}" for i in range(args.workers)]
    else:
        pools = [f"{mode}-shared"] * args.workers
    engine = (lambda: engine_totals(server)) if args.engine_split else None
    return run_phase(server.address, [server.proc.pid], pools, mode, args, engine)


def run_phase(
    address: str,
    pids: list[int],
    pools: list[str],
    mode: str,
    args: argparse.Namespace,
    engine: Callable[[], tuple[float, float]] | None = None,
) -> dict[str, float]:
    """Worker ``i`` of ``args.workers`` drives ``pools[i]`` (created here, sized for its
    workers, deleted at the end) through ``address`` (a server or a replica set); the
    server CPU is the sum over ``pids``; ``engine`` reads (engine seconds, operations)."""
    admin = KVCoordClient(address, timeout=60)
    for name in sorted(set(pools)):
        admin.create_pool(name, pool_config(worker_blocks(args.running) * pools.count(name)))
    workers = WorkerProcs(
        worker_main,
        args.workers,
        lambda i: (address, pools[i], mode, args.running, args.warmup, args.seconds),
    )
    broken: BaseException | None = None
    try:
        try:
            workers.barrier.wait(BARRIER_TIMEOUT)
            cpu0, (busy0, tot0), t0 = sum(map(server_cpu, pids)), machine_ticks(), time.perf_counter()
            engine0 = engine() if engine else (0.0, 0.0)
            workers.barrier.wait(BARRIER_TIMEOUT)
            cpu1, (busy1, tot1), t1 = sum(map(server_cpu, pids)), machine_ticks(), time.perf_counter()
            engine1 = engine() if engine else (0.0, 0.0)
        except threading.BrokenBarrierError as exc:  # a worker failed: its report says why
            broken = exc
        got = workers.gather(60, broken)
    finally:
        workers.reap()
        for name in sorted(set(pools)):
            admin.delete_pool(name)
        admin.close()
    wall = t1 - t0
    ops = sum(g[2] for g in got)
    lat = [x for g in got for x in g[3]]
    return {
        "ops_s": ops / wall,
        "calls_s": len(lat) / wall,
        "ops_call": ops / max(1, len(lat)),
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
        "mean": sum(lat) / len(lat) * 1e3 if lat else float("nan"),
        "srv_us": (cpu1 - cpu0) / ops * 1e6,
        "srv_cores": (cpu1 - cpu0) / wall,
        "wrk_us": sum(g[4] for g in got) / ops * 1e6,
        "busy": (busy1 - busy0) / max(1, tot1 - tot0),
        "ops": ops,
        "wall": wall,
        "engine_us": (engine1[0] - engine0[0]) / max(1.0, engine1[1] - engine0[1]) * 1e6 if engine else 0.0,
    }


def config_text(durability: str, data_dir: str, sync: str) -> str:
    text = '[server]\nlog_level = "WARNING"\nmetrics_listen = ""\n'
    if durability == "none":
        return text + 'durability = "none"\ndata_dir = ""\n'
    return text + f'durability = "journal"\ndata_dir = "{data_dir}"\nsynchronous = "{sync}"\n'


def row(label: str, layout: str, mode: str, m: dict[str, float]) -> str:
    return (
        f"{label:<16} {layout:<6} {mode:<8} {m['ops_s']:8.0f} {m['calls_s']:8.0f} "
        f"{m['ops_call']:8.1f} {m['p50']:8.2f} {m['p99']:8.2f} {m['srv_us']:9.1f} "
        f"{m['srv_cores']:9.2f} {m['wrk_us']:9.1f} {m['busy']:5.0%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--running", type=int, default=64, help="running requests per worker (ops per Step)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured time per phase")
    ap.add_argument("--warmup", type=float, default=1.5, help="per worker, before the measured time")
    ap.add_argument("--pools", nargs="+", choices=("own", "shared"), default=["own", "shared"])
    ap.add_argument("--durability", nargs="+", choices=("none", "journal"), default=["none", "journal"])
    ap.add_argument("--journal-sync", choices=("FULL", "NORMAL", "OFF"), default="FULL")
    ap.add_argument("--modes", nargs="+", choices=("batched", "unary"), default=["batched", "unary"])
    ap.add_argument("--old", metavar="REV", help="also run the server of git revision REV, in turns")
    ap.add_argument("--rounds", type=int, default=3, help="with --old: phases per code and mode")
    ap.add_argument(
        "--engine-split", action="store_true", help="split server CPU per op: the engine's work and the rest"
    )
    args = ap.parse_args()

    cpus = os.cpu_count()
    print(
        f"machine: {cpus} CPUs ({len(os.sched_getaffinity(0))} usable), Python {sys.version.split()[0]}; "
        f"the server and {args.workers} workers share them: every figure is bounded by that"
    )
    print(
        f"workload: {args.workers} workers x {args.running} running requests in decode, "
        f"{args.seconds:g} s measured after {args.warmup:g} s warm-up per phase"
    )
    print(
        "load average (1, 5, 15 min) at start: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + "  (busy = the whole machine's, other processes included)"
    )
    trees = {"new": ROOT}
    if args.old:
        trees = {"old": old_tree(args.old), "new": ROOT}
    rounds = args.rounds if args.old else 1
    header = (
        f"{'durability':<16} {'pools':<6} {'mode':<8} {'ops/s':>8} {'calls/s':>8} {'ops/call':>8} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'srv µs/op':>9} {'srv cores':>9} {'wrk µs/op':>9} "
        f"{'busy':>5}"
    )
    summary: list[str] = []
    print(header)
    for durability in args.durability:
        tmp = tempfile.mkdtemp(prefix="kvcoord-workers-")
        label = durability if durability == "none" else f"journal {args.journal_sync}"
        servers: dict[str, ServerProcess] = {}
        try:
            for code, tree in trees.items():
                text = config_text(durability, os.path.join(tmp, f"data-{code}"), args.journal_sync)
                if args.engine_split:
                    text = text.replace('metrics_listen = ""\n', "")
                env = dict(
                    os.environ, PYTHONPATH=os.pathsep.join([str(tree / "client"), str(tree / "server")])
                )
                servers[code] = start_server(text, env=env, metrics=args.engine_split)
            for layout in args.pools:
                r: dict[tuple[str, str], list[dict[str, float]]] = {}
                for k in range(rounds):
                    for mode in args.modes:
                        for code, server in servers.items():
                            m = phase(server, layout, mode, args)
                            r.setdefault((code, mode), []).append(m)
                            tag = label if not args.old else f"{label} {code} r{k + 1}"
                            print(row(tag, layout, mode, m), flush=True)
                            if args.engine_split and mode == "batched":
                                print(
                                    f"{'':16} {'':6} {'':8}   server µs/op: engine {m['engine_us']:.1f} "
                                    f"(applying the operations), the rest {m['srv_us'] - m['engine_us']:.1f}",
                                    flush=True,
                                )
                med = {key: {f: statistics.median(x[f] for x in ms) for f in ms[0]} for key, ms in r.items()}
                if args.old:
                    for mode in args.modes:
                        old, new = med[("old", mode)], med[("new", mode)]
                        summary.append(
                            f"{label:<12} {layout:<6} {mode:<8} median over {rounds} rounds: server µs/op "
                            f"old {old['srv_us']:.1f}, new {new['srv_us']:.1f} (new/old "
                            f"{new['srv_us'] / old['srv_us']:.2f}); ops/s old {old['ops_s']:.0f}, new "
                            f"{new['ops_s']:.0f}; p99 ms old {old['p99']:.2f}, new {new['p99']:.2f}"
                        )
                if "batched" in args.modes and "unary" in args.modes:
                    for code in servers:
                        b, u = med[(code, "batched")], med[(code, "unary")]
                        ratio = b["ops_s"] / u["ops_s"]
                        summary.append(
                            f"{label:<12} {layout:<6} {code} batched/unary ops/s {ratio:5.1f} x "
                            f"({'meets' if ratio >= 10 else 'MISSES'} >= 10 x); "
                            f"server CPU per op unary/batched {u['srv_us'] / b['srv_us']:5.1f} x"
                        )
        finally:
            for server in servers.values():
                server.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    if args.old:
        shutil.rmtree(trees["old"], ignore_errors=True)
    print("\n".join(summary))
    print("load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
