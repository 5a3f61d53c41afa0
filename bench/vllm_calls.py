"""Per-call CPU of vLLM's KVCacheManager calls: vLLM's own manager against kvcoord's
predicted one (``KVCoordScheduler``, ``KVCOORD_PREDICT=1``), in one process.

    KVCOORD_VENV=$(scripts/install_vllm.sh --print-venv)
    PYTHONPATH=client:server:tests PYTHONHASHSEED=0 $KVCOORD_VENV/bin/python bench/vllm_calls.py \\
        [--running 256] [--layout full] [--kind sync] [--steps 150] [--warmup 150]

The workload is ``bench/vllm_step.py``'s. Each manager method the scheduler calls is
wrapped and timed with the calling thread's CPU clock (``time.thread_time``), which a
loaded machine disturbs far less than the wall clock: time spent descheduled or waiting
for the GIL is not counted. Prints, per method, the mean and the 25th percentile of its
calls (microseconds) for both managers and their ratio (``allocate_slots`` also by what
each call did: a running request's step inside its blocks or taking blocks, a waiting
request's first allocation), and per step: the CPU of all
timed calls, of the scheduler's thread, and of the whole process (the sender thread
included; the server's CPU is not).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
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


def measure(sched: Any, n: int, steps: int, warmup: int) -> dict[str, float]:
    manager = sched.kv_cache_manager
    times: dict[str, list[float]] = collections.defaultdict(list)
    on = [False]
    for name in METHODS:
        inner = getattr(manager, name)

        def timed(*args: Any, _inner: Any = inner, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            out = _inner(*args, **kwargs)
            if on[0]:
                took = time.thread_time() - t0
                times[_name].append(took)
                if _name == "allocate_slots":  # by path (read after the clock stopped)
                    times[f"allocate_slots ({_path(args, kwargs, out)})"].append(took)
            return out

        setattr(manager, name, timed)
    start: dict[str, float] = {}
    done = [0]

    def between() -> None:
        done[0] += 1
        if done[0] == warmup:
            on[0] = True
            start["thread"], start["process"] = time.thread_time(), time.process_time()

    freeze_heap()
    run(sched, n, steps + warmup, seed=n, counter=None, between=between)
    out = {
        "timed calls, ms / step": sum(sum(v) for v in times.values()) / steps * 1e3,
        "scheduler thread CPU, ms / step": (time.thread_time() - start["thread"]) / steps * 1e3,
        "process CPU, ms / step": (time.process_time() - start["process"]) / steps * 1e3,
    }
    for name, v in times.items():
        out[f"{name} mean us"] = statistics.fmean(v) * 1e6
        out[f"{name} p25 us"] = sorted(v)[len(v) // 4] * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--layout", default="full", choices=["full", "full+swa"])
    ap.add_argument("--kind", default="sync", choices=["sync", "async"])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=150)
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    server = start_server("", env=dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}"))
    model = write_model_dir(Path(tempfile.mkdtemp(prefix="kvcoord-bench-model-")))
    n = args.running
    blocks = n * (900 + 128) // BLOCK_SIZE * 2 + 64

    def config() -> Any:
        return vllm_config(
            model, blocks, async_scheduling=args.kind == "async", max_num_seqs=n, max_num_batched_tokens=8192
        )

    os.environ.update(KVCOORD_TARGET=server.address, KVCOORD_PREDICT="1", KVCOORD_POOL="bench-calls")
    try:
        ours = SCHEDULERS[args.kind]
        theirs = make_scheduler(ours, config(), kv_cache_config(args.layout, blocks))
        base = measure(theirs, n, args.steps, args.warmup)
        cls = KVCoordAsyncScheduler if args.kind == "async" else KVCoordScheduler
        remote = make_scheduler(cls, config(), kv_cache_config(args.layout, blocks))
        got = measure(remote, n, args.steps, args.warmup)
        remote.shutdown()
    finally:
        server.stop()
    print(f"{n} running, {args.layout}, {args.kind}: {'':<24} {'vLLM':>9} {'kvcoord':>9} {'x':>6}")
    for key, value in base.items():
        if key in got:
            print(f"{key:<48} {value:9.2f} {got[key]:9.2f} {got[key] / value:6.2f}")


if __name__ == "__main__":
    main()
