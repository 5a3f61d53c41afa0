"""Per-call CPU of vLLM's KVCacheManager calls: vLLM's own manager against kvcoord's
predicted one (``KVCoordScheduler``, ``KVCOORD_PREDICT=1``), in one process.

    KVCOORD_VENV=$(scripts/install_vllm.sh --print-venv)
    PYTHONPATH=client:server:tests PYTHONHASHSEED=0 $KVCOORD_VENV/bin/python bench/vllm_calls.py \\
        [--running 256] [--layout full] [--kind sync] [--steps 150] [--warmup 150] [--interleave] \
        [--model-ms 0] [--engine-build DIR] [--rounds 1] [--no-gc] [--pin [--pin-sender 0|1]]

The workload is ``bench/vllm_step.py``'s. Each manager method the scheduler calls is
wrapped and timed with the calling thread's CPU clock (``time.thread_time``), which a
loaded machine disturbs far less than the wall clock: time spent descheduled or waiting
for the GIL is not counted. Prints, per method, the mean and the 25th percentile of its
calls (microseconds) for both managers and their ratio (``allocate_slots`` also by what
each call did: a running request's step inside its blocks or taking blocks, a waiting
request's first allocation), and per step: the CPU of all
timed calls, of the scheduler's thread, and of the whole process (the sender thread
included; the server's CPU is not). With ``--interleave`` the two schedulers step in
turns (one step each, each on its own thread), so that a machine whose load moves
during the run moves both sides alike: the per-call figures to read on a shared
machine (the process CPU is then not given).

``--model-ms X``: the model runs X ms between ``schedule()`` and ``update_from_output()``
(a sleep, as ``bench/vllm_step.py``'s: the GIL released, as vLLM's engine core waits for
its workers), when a predicted session's sender thread writes, sends and checks the Step
cut at the step before. With 0 (the default) that thread's work takes the GIL during the
scheduler's calls, and a call that hands it over pays the switch in its thread CPU.

``--rounds R``: the comparison is run R times, each with fresh schedulers on the same
workload, and each figure printed is the median over the rounds (its ratio the median
of the paired ratios): one round's ratio moves by 0.2 between two runs on this 2-core
machine.

The scheduler thread's CPU is split as Linux's per-thread ``getrusage`` splits it (user
and system: tick-sampled, so read over hundreds of steps), with its voluntary and
involuntary context switches, and the cyclic collections its steps set off (their count
and CPU, from ``gc.callbacks``). What a valgrind count (``bench/vllm_calls_instructions.py``)
cannot see: ``--no-gc`` turns the collector off after the heap's freeze (as that bench
does); ``--pin`` puts both schedulers' threads on CPU 0 and kvcoord's server and sender
thread on CPU 1 (``--pin-sender 0``: the sender thread on CPU 0 too), from the first
measured step.

``--engine-build DIR``: kvcoord's engine (the client's predictions and the server) is
the compiled one built in DIR (``python bench/compile_engine.py DIR`` with a Python
of the venv's version, 3.11), put first on the path. Run once with and once without it to compare the two against
vLLM's manager.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: ``--engine-build DIR`` (read before the imports below, which it decides)
ENGINE_BUILD = (
    [str(Path(sys.argv[sys.argv.index("--engine-build") + 1]).resolve())]
    if "--engine-build" in sys.argv
    else []
)
sys.path[:0] = [
    *ENGINE_BUILD,
    str(ROOT / "bench"),
    str(ROOT / "client"),
    str(ROOT / "server"),
    str(ROOT / "tests" / "with_vllm"),
]

from common import freeze_heap  # noqa: E402
from harness import BLOCK_SIZE, SCHEDULERS, kv_cache_config, make_scheduler, vllm_config, write_model_dir  # noqa: E402
from kvcoord.client.testing import start_server  # noqa: E402
from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler  # noqa: E402
from vllm_step import run  # noqa: E402

METHODS = (
    "allocate_slots",
    "get_computed_blocks",
    "free",
    "take_events",
    "get_blocks",
    "make_prefix_cache_stats",
)


def _path(args: Any, kwargs: Any, out: Any) -> str:
    """What an ``allocate_slots`` call did: a running request's step inside its blocks,
    one taking blocks, a waiting request's first allocation, or a refusal."""
    if out is None:
        return "refused"
    if len(args) > 2 or any(k != "num_lookahead_tokens" for k in kwargs):  # vLLM's waiting loop
        return "first"
    return "taking" if any(out.get_block_ids()) else "inside"


#: ``--pin``: the schedulers' threads on CPU 0, kvcoord's sender thread and server on CPU 1
#: (``--pin-sender 0``: the sender thread on CPU 0 too)
PIN = "--pin" in sys.argv
SENDER_CPU = int(sys.argv[sys.argv.index("--pin-sender") + 1]) if "--pin-sender" in sys.argv else 1


def pin_threads() -> None:
    """``--pin``, on the scheduler's thread at its first measured step: this thread on
    CPU 0 and every kvcoord sender thread on CPU 1 (a sender thread is made by the
    first cut, on the scheduler's thread, whose CPUs it inherits)."""
    os.sched_setaffinity(0, {0})  # (0: the calling thread)
    for t in threading.enumerate():
        if t.name == "kvcoord-sender" and t.native_id is not None:
            os.sched_setaffinity(t.native_id, {SENDER_CPU})


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (threads made later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # (gone meanwhile)


#: per thread (ident): [collections, CPU seconds in them] while measured (``GC_WATCH``)
GC_SPENT: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0.0])
_GC_START: dict[int, float] = {}


def _gc_watch(phase: str, info: dict[str, Any]) -> None:
    """A collection's CPU on the thread that set it off (the allocation that crossed
    the threshold): which scheduler's step pays it."""
    ident = threading.get_ident()
    if phase == "start":
        _GC_START[ident] = time.thread_time()
    elif ident in _GC_START:
        spent = GC_SPENT[ident]
        spent[0] += 1
        spent[1] += time.thread_time() - _GC_START.pop(ident)


class _Side:
    """One scheduler's manager with each method timed (from the ``warmup``-th step on)."""

    def __init__(self, sched: Any, warmup: int) -> None:
        self.sched = sched
        self.warmup = warmup
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.on = False
        self.done = 0
        self.start: dict[str, float] = {}
        self.rusage: Any = None
        self.ident = 0
        manager = sched.kv_cache_manager
        for name in METHODS:
            inner = getattr(manager, name)

            def timed(*args: Any, _inner: Any = inner, _name: str = name, **kwargs: Any) -> Any:
                t0 = time.thread_time()
                out = _inner(*args, **kwargs)
                if self.on:
                    took = time.thread_time() - t0
                    self.times[_name].append(took)
                    if _name == "allocate_slots":  # by path (read after the clock stopped)
                        self.times[f"allocate_slots ({_path(args, kwargs, out)})"].append(took)
                return out

            setattr(manager, name, timed)

    def between(self) -> None:
        self.done += 1
        if self.done == self.warmup:
            self.on = True
            self.start["thread"], self.start["process"] = time.thread_time(), time.process_time()
            if PIN:
                pin_threads()
            self.ident = threading.get_ident()
            GC_SPENT.pop(self.ident, None)
            self.rusage = resource.getrusage(resource.RUSAGE_THREAD)

    def result(self, steps: int, process: bool = True) -> dict[str, float]:
        """The figures (called on the scheduler's thread once its steps are done)."""
        times = self.times
        out = {
            "timed calls, ms / step": sum(sum(v) for k, v in times.items() if k in METHODS) / steps * 1e3,
            "scheduler thread CPU, ms / step": (time.thread_time() - self.start["thread"]) / steps * 1e3,
        }
        # the thread's CPU split (Linux's per-thread rusage): kernel time is CPU that no
        # instruction count of the process (valgrind's) sees: futex wakes, context switches
        now, then = resource.getrusage(resource.RUSAGE_THREAD), self.rusage
        out["scheduler thread user CPU, ms / step"] = (now.ru_utime - then.ru_utime) / steps * 1e3
        out["scheduler thread system CPU, ms / step"] = (now.ru_stime - then.ru_stime) / steps * 1e3
        out["scheduler thread voluntary switches / step"] = (now.ru_nvcsw - then.ru_nvcsw) / steps
        out["scheduler thread involuntary switches / step"] = (now.ru_nivcsw - then.ru_nivcsw) / steps
        collections_, gc_seconds = GC_SPENT[self.ident]
        out["collections on the scheduler thread / step"] = collections_ / steps
        out["their CPU, ms / step"] = gc_seconds / steps * 1e3
        if process:
            out["process CPU, ms / step"] = (time.process_time() - self.start["process"]) / steps * 1e3
        for name, v in times.items():
            out[f"{name} mean us"] = statistics.fmean(v) * 1e6
            out[f"{name} p25 us"] = sorted(v)[len(v) // 4] * 1e6
            out[f"{name} ms / step"] = sum(v) / steps * 1e3
        return out


def measure(sched: Any, n: int, steps: int, warmup: int, model_s: float = 0.0) -> dict[str, float]:
    side = _Side(sched, warmup)
    freeze_heap()
    if "--no-gc" in sys.argv:
        gc.disable()
    run(sched, n, steps + warmup, seed=n, counter=None, between=side.between, model_s=model_s)
    return side.result(steps)


def measure_interleaved(
    scheds: list[Any], n: int, steps: int, warmup: int, model_s: float = 0.0
) -> list[dict[str, float]]:
    """Both schedulers step in turns, each on a thread of its own (one steps while the
    other waits), so that the machine's load moves both sides' figures alike; the
    process CPU is not given (a sender thread may work during the other's turn)."""
    sides = [_Side(s, warmup) for s in scheds]
    turns = [threading.Semaphore(1), threading.Semaphore(0)]
    total = steps + warmup
    results: list[dict[str, float]] = [{}, {}]

    def go(i: int) -> None:
        side = sides[i]

        def between() -> None:
            side.between()
            turns[1 - i].release()
            if side.done < total:
                turns[i].acquire()

        turns[i].acquire()
        try:
            run(side.sched, n, total, seed=n, counter=None, between=between, model_s=model_s)
            results[i] = side.result(steps, process=False)
        finally:
            turns[1 - i].release()  # (the other side ends alone)

    freeze_heap()
    if "--no-gc" in sys.argv:
        gc.disable()
    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--layout", default="full", choices=["full", "full+swa"])
    ap.add_argument("--kind", default="sync", choices=["sync", "async"])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the comparison R times (fresh schedulers, the same workload) and print medians",
    )
    ap.add_argument(
        "--interleave", action="store_true", help="both managers step in turns (see measure_interleaved)"
    )
    ap.add_argument("--model-ms", type=float, default=0.0, help="the model's run per step (a sleep), ms")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="the schedulers' threads on CPU 0, kvcoord's server and sender thread on CPU 1 (from the first "
        "measured step): whether what runs beside the scheduler on its CPU moves its CPU time",
    )
    ap.add_argument(
        "--no-gc",
        action="store_true",
        help="the cyclic collector off from the heap's freeze on (as bench/vllm_calls_instructions.py measures)",
    )
    ap.add_argument(
        "--pin-sender",
        type=int,
        default=1,
        choices=[0, 1],
        help="with --pin: the CPU of kvcoord's sender thread (0: the schedulers' own)",
    )
    ap.add_argument(
        "--engine-build", metavar="DIR", help="the compiled engine built in DIR (client and server)"
    )
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    import kvcoord.engine.pool

    print(f"engine: {kvcoord.engine.pool.__file__}")
    gc.callbacks.append(_gc_watch)
    path = ":".join([*ENGINE_BUILD, str(ROOT / "client"), str(ROOT / "server")])
    server = start_server("", env=dict(os.environ, PYTHONPATH=path))
    if args.pin:
        pin_process(server.proc.pid, {1})
    model = write_model_dir(Path(tempfile.mkdtemp(prefix="kvcoord-bench-model-")))
    n = args.running
    blocks = n * (900 + 128) // BLOCK_SIZE * 2 + 64

    def config() -> Any:
        return vllm_config(
            model, blocks, async_scheduling=args.kind == "async", max_num_seqs=n, max_num_batched_tokens=8192
        )

    os.environ.update(KVCOORD_TARGET=server.address, KVCOORD_PREDICT="1", KVCOORD_POOL="bench-calls")
    cls = KVCoordAsyncScheduler if args.kind == "async" else KVCoordScheduler
    rounds: list[tuple[dict[str, float], dict[str, float]]] = []
    try:
        for r in range(args.rounds):
            ours = SCHEDULERS[args.kind]
            theirs = make_scheduler(ours, config(), kv_cache_config(args.layout, blocks))
            if args.interleave:
                remote = make_scheduler(cls, config(), kv_cache_config(args.layout, blocks))
                base, got = measure_interleaved(
                    [theirs, remote], n, args.steps, args.warmup, args.model_ms / 1e3
                )
            else:
                base = measure(theirs, n, args.steps, args.warmup, args.model_ms / 1e3)
                remote = make_scheduler(cls, config(), kv_cache_config(args.layout, blocks))
                got = measure(remote, n, args.steps, args.warmup, args.model_ms / 1e3)
            remote.shutdown()
            rounds.append((base, got))
            if args.rounds > 1:
                key = "timed calls, ms / step"
                print(
                    f"round {r + 1}: {key} {base[key]:.2f} vs {got[key]:.2f} = {got[key] / base[key]:.2f} x"
                )
    finally:
        server.stop()
    head = f"{n} running, {args.layout}, {args.kind}, model {args.model_ms:g} ms"
    if args.rounds > 1:
        head += f", median of {args.rounds} rounds (x: median of the paired ratios)"
    print(f"{head}: {'':<12} {'vLLM':>9} {'kvcoord':>9} {'x':>6}")
    for key in rounds[0][0]:
        pairs = [(b[key], g[key]) for b, g in rounds if key in b and key in g]
        if len(pairs) != len(rounds):
            continue
        base_v = statistics.median(b for b, _ in pairs)
        got_v = statistics.median(g for _, g in pairs)
        ratio = statistics.median(g / b for b, g in pairs) if all(b for b, _ in pairs) else float("nan")
        print(f"{key:<48} {base_v:9.2f} {got_v:9.2f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
