"""vLLM 0.16.0's own Scheduler, in-process and on kvcoord, side by side in one run.

    KVCOORD_VENV=$(scripts/install_vllm.sh --print-venv)
    PYTHONPATH=client:server:tests PYTHONHASHSEED=0 $KVCOORD_VENV/bin/python bench/vllm_step.py \\
        [--running 16 64 256] [--steps 200] [--warmup 150] [--layouts full full+swa] \\
        [--kinds sync async] [--modes exclusive predicted] [--model-ms 5 0] [--pools ample fill] [--rounds 3] \\
        [--model-touch-mb 8] [--switch-interval 0.0002]

For each number of running requests the same seeded workload (prompts 256-900 tokens,
half sharing one of 8 prefixes, 16-128 output tokens, token budget 8,192, full attention
or full + sliding window, prefix caching, events and stats on; new requests arrive as
others finish, so that N are always in the scheduler, running or waiting) runs with each
``--pools`` choice, each a row group of its own: ``ample``, a pool with room for every
request at its longest (nothing is ever preempted, no request waits for blocks: the
flattering side), and ``fill``, 24 blocks a request on full attention and 40 on full +
sliding window (about 60 % of what the requests would hold), so that at 16, 64 and 256
the pool fills, requests wait for blocks and vLLM's scheduler preempts in the measured
steps (each row group's first line says so: the pool's peak and mean usage, the
preemptions, the running and waiting counts, from the scheduler stats
``update_from_output()`` returns, the same for both managers). It runs through
vLLM's ``Scheduler`` (or ``AsyncScheduler``, driven one step after the other) with its in-process KVCacheManager and with
``KVCoordScheduler`` (``KVCoordAsyncScheduler``) on a kvcoord server process on
loopback: ``exclusive`` without prediction (``KVCOORD_PREDICT=0``, one round trip when
an answer needs the server), ``predicted`` with it (``KVCOORD_PREDICT=1``, the
default: every call answered from the client's mirror of the pool; its round trip is a
burst of probes before and after the row, since a probe between steps would let its
Step in flight finish untimed). A step is ``schedule()`` plus
``update_from_output()`` with a fake model output; between the two the model runs
(``--model-ms``, each value a row group of its own: 5 ms by default, a realistic
forward time, and 0, the steps back to back): a sleep, untimed, for vLLM's own
scheduler and kvcoord's alike (the GIL released, as vLLM's engine core waits for its
workers), in which the predicted client's sender thread sends the Step the previous
step's cut handed it. Under each predicted row: what its slowest 1 % of steps are
made of (the wait for the Step in flight, garbage collection, new requests admitted,
requests finished, preempted and resumed, and vLLM's own time on the same steps: the
decisions being the same, step i does the same work under both managers),
the steps that waited, and the sender thread's CPU per step with the share of it
spent inside the model's run; under each row, the collections (by generation) and their
time inside the timed step, for each manager. Prints p50 / mean / p99 per step, the
round trips per step (every RPC the manager's client makes; mean and max) and the
milliseconds kvcoord adds, the p50 over (vLLM's p50 + one no-op round trip: a ListPools
sent after each step of the row, untimed by the step, p50), and checks that every step's
scheduler output, and its running and waiting counts and the pool's usage, are identical. With ``--rounds R`` each row runs R times, vLLM's and
kvcoord's in turns (the order reversed every other round, each on a scheduler and pool
of its own), and ends with the medians of the paired per-round ratios and in how many
rounds the p99 stayed within vLLM's p99 plus two round trips: the same row run twice
in a row differs by about as much as the gap measured (vLLM's own p50 at 256 running
moved 4.4-6.8 ms between runs on a quiet machine), so a single pair decides nothing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "tests" / "with_vllm")]

from common import freeze_heap, pct  # noqa: E402
from harness import (  # noqa: E402
    BLOCK_SIZE,
    SCHEDULERS,
    fake_runner_output,
    kv_cache_config,
    make_scheduler,
    summarize,
    vllm_config,
    write_model_dir,
)
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.testing import start_server  # noqa: E402
from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

VOCAB = 1000


#: memory the model's run writes before its sleep (``--model-touch-mb``; empty: none)
MODEL_TOUCHES = bytearray()


class Collections:
    """The cyclic collector's runs by generation and their wall time, counted by a
    ``gc.callbacks`` entry (on whichever thread a collection runs: one on the sender
    thread holds the GIL too); :func:`run` reads it around a step's timed parts."""

    def __init__(self) -> None:
        self.by_gen = [0, 0, 0]
        self.seconds = 0.0
        self._at = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._at = time.perf_counter()
            self.by_gen[info["generation"]] += 1
        else:
            self.seconds += time.perf_counter() - self._at

    def read(self) -> tuple[int, int, int, float]:
        g0, g1, g2 = self.by_gen
        return g0, g1, g2, self.seconds


#: counted from ``main()`` on, every row's steps alike
COLLECTIONS = Collections()


def run(
    sched: Any,
    running: int,
    steps: int,
    seed: int,
    counter: list[int] | None,
    between: Any = None,
    model_s: float = 0.0,
    gap: Any = None,
    stats: list[tuple[int, int, float]] | None = None,
    cpu: list[float] | None = None,
    collected: list[tuple[float, ...]] | None = None,
) -> tuple[list[float], list[Any]]:
    """Seconds per step (``schedule()`` plus ``update_from_output()``) and each step's
    summarized output; between the two the model runs for ``model_s`` seconds (a sleep,
    untimed: the GIL released, as vLLM's engine core waits for its workers), with
    ``gap(True)`` and ``gap(False)`` called at its start and end when given;
    ``between()`` (when given) is called after each step, untimed by it. ``stats``
    (when given) gets each step's running and waiting counts and the pool's usage, as
    ``update_from_output()`` returned them in its scheduler stats (read untimed);
    ``cpu`` (when given) each step's CPU seconds on the scheduler's thread (the timed
    parts only: what the step's work cost, whether or not the thread got a core and
    the GIL when it wanted them)."""
    hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(VOCAB) for _ in range(rnd.choice((64, 128, 256)))] for _ in range(8)]
    nid = 0

    def add() -> None:
        nonlocal nid
        n = rnd.randint(256, 900)
        tokens = (
            (rnd.choice(prefixes) if rnd.random() < 0.5 else []) + [rnd.randrange(VOCAB) for _ in range(n)]
        )[:n]
        params = SamplingParams(max_tokens=rnd.randint(16, 128), ignore_eos=True)
        sched.add_request(Request(f"r{nid}", tokens, params, None, None, block_hasher=hasher))
        nid += 1

    for _ in range(running):
        add()
    times, trace = [], []
    clock, cpu_clock = time.perf_counter, time.thread_time
    c0 = c1 = c2 = 0.0
    k0 = k1 = k2 = COLLECTIONS.read()
    for _ in range(steps):
        while len(sched.requests) < running:
            add()
        if counter is not None:
            counter.append(0)
        if collected is not None:
            k0 = COLLECTIONS.read()
        if cpu is not None:
            c0 = cpu_clock()
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        if collected is not None:
            k1 = COLLECTIONS.read()
        if cpu is not None:
            c1 = cpu_clock()
        if gap is not None:
            gap(True)
        if model_s:
            if MODEL_TOUCHES:
                MODEL_TOUCHES[:] = bytes(len(MODEL_TOUCHES))  # the run's host work: caches cold after it
            time.sleep(model_s)
        if gap is not None:
            gap(False)
        if cpu is not None:
            c2 = cpu_clock()
        if collected is not None:
            k2 = COLLECTIONS.read()
        t2 = clock()
        outs = sched.update_from_output(out, fake_runner_output(sched, out))
        times.append(clock() - t2 + (t1 - t0))
        if collected is not None:
            k3 = COLLECTIONS.read()
            collected.append(tuple(b - a + d - c for a, b, c, d in zip(k0, k1, k2, k3, strict=True)))
        if cpu is not None:
            cpu.append(cpu_clock() - c2 + (c1 - c0))
        if stats is not None:
            s = outs[0].scheduler_stats
            stats.append((s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage))
        trace.append(summarize(out))
        if between is not None:
            between()
    return times, trace


class Makeup:
    """What a predicted row's steps are made of, besides the step's own calls: per step,
    the wait for the Step in flight (the backlog was full), the garbage collector's
    time and the new requests admitted; and the sender thread's CPU, inside the model's
    run (the gap between ``schedule()`` and ``update_from_output()``) and outside it."""

    def __init__(self, manager: Any, warmup: int) -> None:
        self.manager, self.warmup = manager, warmup
        self.waits: list[float] = []
        self.gcs: list[float] = []
        self._gc = 0.0
        self._gc_at = 0.0
        self._waited = 0.0
        self._step = 0
        self._clock: int | None = None
        self._at = 0.0
        #: the sender thread's CPU seconds in the model's gaps and in all, measured steps
        self.in_gaps = 0.0
        self.total = 0.0
        #: the Steps the manager sent in the run (set after it)
        self.steps_sent = 0
        self._start = 0.0

    def _collector(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_at = time.perf_counter()
        else:
            self._gc += time.perf_counter() - self._gc_at

    def __enter__(self) -> Makeup:
        gc.callbacks.append(self._collector)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._collector)
        if self._clock is not None:
            self.total = time.clock_gettime(self._clock) - self._start

    def _sender_cpu(self) -> float | None:
        if self._clock is None:
            thread = self.manager.sender.inbox.thread
            if thread is None or thread.ident is None:
                return None
            self._clock = time.pthread_getcpuclockid(thread.ident)
            self._start = time.clock_gettime(self._clock)
        return time.clock_gettime(self._clock)

    def gap(self, starts: bool) -> None:
        """Called at the start and the end of the model's run."""
        if self._step < self.warmup:
            return
        cpu = self._sender_cpu()
        if cpu is None:
            return
        if starts:
            self._at = cpu
        else:
            self.in_gaps += cpu - self._at

    def between(self) -> None:
        """Called after each step."""
        self._step += 1
        waited = self.manager.waited_seconds
        self.waits.append(waited - self._waited)
        self._waited = waited
        self.gcs.append(self._gc)
        self._gc = 0.0
        if self._step == self.warmup:
            self._clock = None  # the sender's CPU counted from here
            self._sender_cpu()

    def report(
        self, times: list[float], trace: list[Any], base: list[float], cpu: list[float], base_cpu: list[float]
    ) -> str:
        """``base``: vLLM's own step times in the same round (the same steps: its
        decisions are the same, step for step); ``cpu``, ``base_cpu``: the scheduler
        thread's CPU per step, kvcoord's and vLLM's."""
        w = self.warmup
        t, waits, gcs, b = times[w:], self.waits[w:], self.gcs[w:], base[w:]
        c, bc = cpu[w:], base_cpu[w:]
        new = [len(s["new"]) for s in trace[w:]]
        freed = [len(s["finished"]) for s in trace[w:]]
        preempted = [len(s["preempted"]) for s in trace[w:]]
        resumed = [len(s["resumed"]) for s in trace[w:]]
        top = sorted(range(len(t)), key=t.__getitem__)[int(len(t) * 0.99) :]
        k = len(top)
        # vLLM's own slowest 1 %: the steps that cost most whatever the manager
        vtop = sorted(range(len(b)), key=b.__getitem__)[int(len(b) * 0.99) :]
        # the 1 % costing the scheduler's thread most CPU, and the CPU kvcoord adds to
        # vLLM's on the same step, fitted to the step's new requests
        ctop = sorted(range(len(c)), key=c.__getitem__)[int(len(c) * 0.99) :]
        extra = [x - y for x, y in zip(c, bc, strict=True)]
        try:
            slope, intercept = statistics.linear_regression(new, extra)
        except statistics.StatisticsError:  # every step admitted as many
            slope, intercept = 0.0, statistics.fmean(extra)

        def mean_ms(xs: list[float], ix: list[int]) -> float:
            return sum(xs[i] for i in ix) / max(1, len(ix)) * 1e3

        inside = self.in_gaps / self.total * 100 if self.total else 0.0
        return (
            f"{'':>7} {'':<22} p99 steps ({k}): {mean_ms(t, top):.2f} ms, of which waiting for the Step in "
            f"flight {mean_ms(waits, top):.2f}, garbage collection {mean_ms(gcs, top):.2f}; "
            f"{sum(new[i] for i in top) / max(1, k):.1f} new requests (all steps: {statistics.fmean(new):.1f}), "
            f"{sum(freed[i] for i in top) / max(1, k):.1f} finished (all: {statistics.fmean(freed):.1f}), "
            f"{sum(preempted[i] for i in top) / max(1, k):.1f} preempted (all: {statistics.fmean(preempted):.2f}), "
            f"{sum(resumed[i] for i in top) / max(1, k):.1f} resumed (all: {statistics.fmean(resumed):.2f}); vLLM's own step on the same steps {mean_ms(b, top):.2f} ms "
            f"(its own p99 steps {mean_ms(b, vtop):.2f}, {len(set(top) & set(vtop))} of them the same steps)\n"
            f"{'':>7} {'':<22} scheduler thread CPU: on those p99 steps {mean_ms(c, top):.2f} ms (vLLM's on them "
            f"{mean_ms(bc, top):.2f}); per step p50 {_figures(c)[0]:.2f} / mean {_figures(c)[1]:.2f} / p99 "
            f"{_figures(c)[2]:.2f} ms against vLLM's {_figures(bc)[0]:.2f} / {_figures(bc)[1]:.2f} / "
            f"{_figures(bc)[2]:.2f}; its p99 steps by CPU {mean_ms(c, ctop):.2f} ms (vLLM's on them "
            f"{mean_ms(bc, ctop):.2f}), {sum(new[i] for i in ctop) / max(1, len(ctop)):.1f} new requests; the CPU "
            f"kvcoord adds to vLLM's on a step: {intercept * 1e3:.2f} ms + {slope * 1e3:.2f} ms a new request\n"
            f"{'':>7} {'':<22} all measured steps: waited {sum(waits) * 1e3:.1f} ms in "
            f"{sum(1 for x in waits if x > 1e-4)} of {len(t)} (over 0.1 ms); {self.steps_sent} Steps sent in the run; the sender "
            f"thread's CPU {self.total / len(t) * 1e3:.2f} ms / step, {inside:.0f} % of it in the model's run"
        )


def _figures(t: list[float]) -> tuple[float, float, float]:
    """p50, mean and p99 of ``t`` (seconds), in milliseconds."""
    return sorted(t)[len(t) // 2] * 1e3, statistics.fmean(t) * 1e3, pct(t, 0.99)


#: ``fill`` pools: blocks a running request's share (the requests would hold about 41
#: full-attention blocks each at their mean length, 650 tokens; a full + sliding-window
#: request's admission also takes its whole prompt in the window's group, freed a step
#: later), so that at 16, 64 and 256 running the pool fills, requests wait and vLLM's
#: scheduler preempts in the measured steps
FILL_BLOCKS = {"full": 24, "full+swa": 40}


def pool_blocks(pools: str, layout: str, n: int) -> int:
    """The pool's blocks for ``n`` running requests: ``ample``, room for every request
    at its longest in each group (nothing is ever preempted, no request waits for
    blocks); ``fill``, :data:`FILL_BLOCKS` a request."""
    if pools == "ample":
        return n * (900 + 128) // BLOCK_SIZE * 2 + 64
    return n * FILL_BLOCKS[layout]


def fill_line(trace: list[Any], stats: list[tuple[int, int, float]], blocks: int, warmup: int) -> str:
    """How full the pool ran in the measured steps (the same for every manager: their
    decisions are)."""
    trace, stats = trace[warmup:], stats[warmup:]
    pre = [len(s["preempted"]) for s in trace]
    running = [s[0] for s in stats]
    waiting = [s[1] for s in stats]
    return (
        f"{'':>7} pool {blocks} blocks: peak usage {max(s[2] for s in stats) * 100:.1f} % (mean "
        f"{statistics.fmean(s[2] for s in stats) * 100:.1f} %); {sum(pre)} preemptions in {sum(1 for x in pre if x)} "
        f"of {len(trace)} measured steps; running {min(running)}-{max(running)} (mean {statistics.fmean(running):.1f}), "
        f"waiting {min(waiting)}-{max(waiting)} (mean {statistics.fmean(waiting):.1f})"
    )


def cls_of(kind: str) -> Any:
    return KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler


def _run_remote(
    args: Any,
    predict: bool,
    cls: Any,
    config: Any,
    layout: str,
    kind: str,
    n: int,
    pools: str,
    blocks: int,
    model_ms: float,
    r: int,
    address: str,
    probe: Any,
    rtts: list[float],
    ping: Any,
    stats: list[tuple[int, int, float]],
    cpu: list[float],
    collected: list[tuple[float, ...]],
) -> tuple[list[float], list[Any], float, list[int], Any]:
    """One row on kvcoord (a pool of its own per round, deleted after it): step times,
    trace, round trip (ms), RPCs per step and, predicted, what its steps are made of
    (a :class:`Makeup`, else None); each step's scheduler stats into ``stats``."""
    total = args.steps + args.warmup
    os.environ["KVCOORD_TARGET"] = address
    os.environ["KVCOORD_POOL"] = pool = (
        f"bench-{layout.replace('+', '-')}-{kind}-{n}-{pools}-{model_ms:g}-{'predicted' if predict else 'exclusive'}-r{r}"
    )
    os.environ["KVCOORD_PREDICT"] = "1" if predict else "0"
    remote = make_scheduler(cls, config(), kv_cache_config(layout, blocks))
    freeze_heap()
    counts: list[int] = []
    client = remote.kv_cache_manager.remote.client
    inner = client._call

    def counted(rpc: str, request: Any, inner: Any = inner, counts: list[int] = counts) -> Any:
        if counts:
            counts[-1] += 1
        return inner(rpc, request)

    client._call = counted
    rtts.clear()
    manager = remote.kv_cache_manager.remote
    makeup = None
    try:
        if predict:
            # A probe between steps would let the Step in flight finish untimed:
            # the round trip is a burst of probes before and after the row.
            for _ in range(200):
                probe()
            with Makeup(manager, args.warmup) as makeup:
                t, trace = run(remote, n, total, seed=n, counter=counts, between=makeup.between,
                               model_s=model_ms / 1e3, gap=makeup.gap, stats=stats, cpu=cpu,
                               collected=collected)  # fmt: skip
            for _ in range(200):
                probe()
            rtt = pct(rtts, 0.5)
            makeup.steps_sent = manager.steps_sent
        else:
            t, trace = run(remote, n, total, seed=n, counter=counts, between=probe, model_s=model_ms / 1e3,
                           stats=stats, cpu=cpu, collected=collected)  # fmt: skip
            rtt = pct(rtts[args.warmup :], 0.5)
    finally:
        remote.shutdown()
        # (every row's probe and server alike: ListPools answers for every pool there is)
        ping.delete_pool(pool)
    return t, trace, rtt, counts, makeup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=200, help="measured steps per scheduler")
    ap.add_argument(
        "--warmup", type=int, default=150,
        help="steps before the measured ones: the initial batch's prefill and first generation",
    )  # fmt: skip
    ap.add_argument("--layouts", nargs="+", default=["full"], choices=["full", "full+swa"])
    ap.add_argument("--kinds", nargs="+", default=["sync"], choices=["sync", "async"])
    ap.add_argument(
        "--modes", nargs="+", default=["exclusive", "predicted"], choices=["exclusive", "predicted"]
    )
    ap.add_argument(
        "--model-ms", type=float, nargs="+", default=[5.0, 0.0],
        help="the model's run between schedule() and update_from_output() (a sleep, untimed); "
        "0: the steps back to back",
    )  # fmt: skip
    ap.add_argument(
        "--pools", nargs="+", default=["ample", "fill"], choices=["ample", "fill"],
        help="ample: nothing is ever preempted; fill: the pool fills, requests wait and vLLM preempts",
    )  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="each row this many times, vLLM's and kvcoord's in turns (the order alternating), "
        "with the medians of the paired ratios: the same row run twice differs by as much as the gap",
    )  # fmt: skip
    ap.add_argument(
        "--model-touch-mb", type=int, default=0,
        help="the model's run first writes this many MiB (both managers alike), so that the "
        "scheduler's next calls start with caches as cold as after a real forward's host work",
    )  # fmt: skip
    ap.add_argument(
        "--switch-interval", type=float, default=None,
        help="sys.setswitchinterval (s) for the run: how long a thread waiting for the GIL "
        "waits before the holder is asked to drop it (Python's default 0.005)",
    )  # fmt: skip
    args = ap.parse_args()
    MODEL_TOUCHES.extend(bytes(args.model_touch_mb << 20))
    gc.callbacks.append(COLLECTIONS)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}")
    server = start_server("", env=env)
    model = write_model_dir(Path(tempfile.mkdtemp(prefix="kvcoord-bench-model-")))
    ping = KVCoordClient(server.address)
    ping.list_pools()
    rtts: list[float] = []

    def probe() -> None:
        t0 = time.perf_counter()
        ping.list_pools()
        rtts.append(time.perf_counter() - t0)

    for _ in range(200):
        probe()
    print(f"no-op round trip (ListPools) alone p50 {pct(rtts, 0.5):.3f} ms; each row's RTT: one after each "
          "of its steps (untimed by the step), p50")  # fmt: skip
    print(
        f"{'running':>7} {'scheduler':<22} {'p50 ms':>8} {'mean ms':>8} {'p99 ms':>8} {'RTT/step':>9} {'max RTT':>8}"
        f" {'+ms/step':>9} {'vs vLLM+RTT':>11} {'RTT ms':>7} {'p50 x':>6} {'mean x':>6}"
    )
    rows = itertools.product(args.pools, args.model_ms, args.layouts, args.kinds, args.running)
    names = ["vLLM", *args.modes]
    try:
        for pools, model_ms, layout, kind, n in rows:
            blocks = pool_blocks(pools, layout, n)
            total = args.steps + args.warmup
            model_s = model_ms / 1e3

            def config(blocks: int = blocks, n: int = n, kind: str = kind) -> Any:
                return vllm_config(
                    model,
                    blocks,
                    async_scheduling=kind == "async",
                    max_num_seqs=n,
                    max_num_batched_tokens=8192,
                )

            print(f"-- {layout}, {kind}, the model's run {model_ms:g} ms per step (untimed), {pools} pool")
            # per round and name: (p50, mean, p99, rtt) in ms; rounds alternate the order
            figures: list[dict[str, tuple[float, float, float, float]]] = []
            # per round and name: the scheduler thread's CPU per step, p50 / mean / p99 (ms)
            cpu_figures: list[dict[str, tuple[float, float, float]]] = []
            # per name: each measured step's collections (gen 0, 1, 2, seconds), every round
            gcs: dict[str, list[tuple[float, ...]]] = {name: [] for name in names}
            base_trace: list[Any] | None = None
            base_stats: list[tuple[int, int, float]] | None = None
            for r in range(args.rounds):
                got: dict[str, tuple[float, float, float, float]] = {}
                lines: dict[str, tuple[str, Any]] = {}
                times: dict[str, list[float]] = {}
                cpus: dict[str, list[float]] = {}
                for name in names if r % 2 == 0 else names[::-1]:
                    stats: list[tuple[int, int, float]] = []
                    cpus[name] = []
                    collected: list[tuple[float, ...]] = []
                    if name == "vLLM":
                        local = make_scheduler(SCHEDULERS[kind], config(), kv_cache_config(layout, blocks))
                        freeze_heap()
                        t, trace = run(local, n, total, seed=n, counter=None, model_s=model_s, stats=stats,
                                       cpu=cpus[name], collected=collected)  # fmt: skip
                        got[name] = (*_figures(t[args.warmup :]), 0.0)
                        lines[name] = ("", None)
                    else:
                        t, trace, rtt, counts, makeup = _run_remote(
                            args, name == "predicted", cls_of(kind), config, layout, kind, n, pools, blocks,
                            model_ms, r, server.address, probe, rtts, ping, stats, cpus[name], collected,
                        )  # fmt: skip
                        got[name] = (*_figures(t[args.warmup :]), rtt)
                        trips = sum(counts[args.warmup :]) / len(counts[args.warmup :])
                        lines[name] = (f" {trips:9.2f} {max(counts[args.warmup :]):8d}", makeup)
                    times[name] = t
                    gcs[name] += collected[args.warmup :]
                    if base_trace is None:
                        base_trace, base_stats = trace, stats
                    assert trace == base_trace, f"{name}'s scheduler decided differently"
                    # (the running and waiting counts and the pool's usage, step for step)
                    assert stats == base_stats, f"{name}'s scheduler stats differ"
                figures.append(got)
                cpu_figures.append({k: _figures(v[args.warmup :]) for k, v in cpus.items()})
                base, base_mean, base_p99, _ = got["vLLM"]
                tag = f"r{r + 1} " if args.rounds > 1 else ""
                if r == 0:
                    assert base_stats is not None
                    print(fill_line(base_trace, base_stats, blocks, args.warmup))
                print(f"{n:>7} {tag + 'vLLM in-process':<22} {base:8.2f} {base_mean:8.2f} {base_p99:8.2f}")
                for name in args.modes:
                    med, mean, p99, rtt = got[name]
                    label = tag + ("KVCOORD_PREDICT=1" if name == "predicted" else "KVCOORD_PREDICT=0")
                    trips_max, makeup = lines[name]
                    print(f"{n:>7} {label:<22} {med:8.2f} {mean:8.2f} {p99:8.2f}{trips_max}"
                          f" {med - base:9.2f} {med / (base + rtt):11.2f} {rtt:7.3f} {med / base:6.2f}"
                          f" {mean / base_mean:6.2f}")  # fmt: skip
                    if makeup is not None:
                        print(makeup.report(times[name], base_trace, times["vLLM"], cpus[name], cpus["vLLM"]))
            if args.rounds > 1:
                for name in args.modes:
                    p50x = statistics.median(f[name][0] / f["vLLM"][0] for f in figures)
                    meanx = statistics.median(f[name][1] / f["vLLM"][1] for f in figures)
                    held = sum(f[name][2] <= f["vLLM"][2] + 2 * f[name][3] for f in figures)
                    print(f"{n:>7} {name + ', median of rounds':<22} p50 x {p50x:.2f}, mean x {meanx:.2f} (paired per "
                          f"round); p99 <= vLLM's p99 + 2 RTT in {held} of {len(figures)} rounds")  # fmt: skip
                    cpux = [
                        statistics.median(f[name][i] / f["vLLM"][i] for f in cpu_figures) for i in range(3)
                    ]
                    print(f"{n:>7} {'':<22} scheduler thread CPU per step: p50 x {cpux[0]:.2f}, mean x {cpux[1]:.2f}, "
                          f"p99 x {cpux[2]:.2f} (medians of the paired rounds)")  # fmt: skip
            print(f"{n:>7} {'':<22} collections inside the timed step, per measured step (all rounds): "
                  + "; ".join(f"{name} gen 0/1/2 " + "/".join(f"{statistics.fmean(c[i] for c in gcs[name]):.3f}"
                              for i in range(3)) + f", {statistics.fmean(c[3] for c in gcs[name]) * 1e3:.3f} ms"
                              for name in names))  # fmt: skip
        print("scheduler outputs identical on every step")
    finally:
        ping.close()
        server.stop()


if __name__ == "__main__":
    main()
