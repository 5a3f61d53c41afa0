"""Python functions per scheduler step, vLLM's own manager against kvcoord's predicted one
(not a test): how many Python calls a step makes and how many distinct Python functions
it runs, counted with ``sys.setprofile`` on the scheduler's thread inside ``schedule()``
and ``update_from_output()`` (load-independent: counts, not times).

    KVCOORD_VENV=$(scripts/install_vllm.sh --print-venv)
    PYTHONPATH=client:server:tests PYTHONHASHSEED=0 $KVCOORD_VENV/bin/python bench/vllm_step_functions.py \\
        [--running 64] [--warmup 150] [--steps 20] [--list]

The workload is ``bench/vllm_step.py``'s (full attention, sync, an ample pool, a 5 ms
model run between the two calls), on vLLM's ``Scheduler`` and on ``KVCoordScheduler``
with a kvcoord server process on loopback, one after the other. Every function a step
runs for the first time since the model's run starts cold: its code object, bytecode
with its inline caches, function object and the globals it reads are memory the step
touches whatever its instruction count, so the distinct functions per step are a part
of the step's footprint that ``bench/vllm_calls_instructions.py``'s instruction counts
do not show. ``--list``: kvcoord's own functions with their calls per step.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "tests" / "with_vllm")]

from common import freeze_heap  # noqa: E402
from harness import SCHEDULERS, kv_cache_config, make_scheduler, vllm_config, write_model_dir  # noqa: E402
from kvcoord.client.testing import start_server  # noqa: E402
from kvcoord.client.vllm_scheduler import KVCoordScheduler  # noqa: E402
from vllm_step import pool_blocks, run  # noqa: E402


def where(code: Any) -> str:
    """A code object's package: kvcoord's module path, an installed package's name
    (``vllm``) or the file's name."""
    f = code.co_filename
    if "/site-packages/" in f:
        return f.split("/site-packages/")[-1].split("/")[0]
    if "/kvcoord/" in f:
        return "kvcoord." + f.split("/kvcoord/")[-1]
    return Path(f).name


def count(
    sched: Any, running: int, warmup: int, steps: int
) -> tuple[collections.Counter[Any], int, list[int]]:
    """Calls per code object, C calls and each measured step's distinct functions."""
    calls: collections.Counter[Any] = collections.Counter()
    c_calls = 0
    step_codes: set[Any] = set()
    per_step: list[int] = []
    on = False

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal c_calls
        if event == "call":
            calls[frame.f_code] += 1
            step_codes.add(frame.f_code)
        elif event == "c_call":
            c_calls += 1

    def wrap(name: str) -> None:
        inner = getattr(sched, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not on:
                return inner(*args, **kwargs)
            sys.setprofile(profile)
            try:
                return inner(*args, **kwargs)
            finally:
                sys.setprofile(None)

        setattr(sched, name, counted)

    wrap("schedule")
    wrap("update_from_output")
    done = 0

    def between() -> None:
        nonlocal done, on
        done += 1
        if on:
            per_step.append(len(step_codes))
        step_codes.clear()
        on = done >= warmup

    run(sched, running, warmup + steps, seed=running, counter=None, between=between, model_s=0.005)
    return calls, c_calls, per_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--list", action="store_true", help="kvcoord's own functions and their calls per step")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    server = start_server("", env=dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}"))
    model = write_model_dir(Path(tempfile.mkdtemp(prefix="kvcoord-bench-model-")))
    n = args.running
    blocks = pool_blocks("ample", "full", n)
    config = vllm_config(model, blocks, async_scheduling=False, max_num_seqs=n, max_num_batched_tokens=8192)
    try:
        for side in ("vLLM", "kvcoord"):
            if side == "vLLM":
                sched = make_scheduler(SCHEDULERS["sync"], config, kv_cache_config("full", blocks))
            else:
                os.environ.update(
                    KVCOORD_TARGET=server.address, KVCOORD_POOL="bench-functions", KVCOORD_PREDICT="1"
                )
                sched = make_scheduler(KVCoordScheduler, config, kv_cache_config("full", blocks))
            freeze_heap()
            try:
                calls, c_calls, per_step = count(sched, n, args.warmup, args.steps)
            finally:
                if side == "kvcoord":
                    sched.shutdown()
            m = args.steps
            print(
                f"{side}, {n} running: per step {sum(calls.values()) / m:.0f} Python calls, {c_calls / m:.0f} C calls, "
                f"{sum(per_step) / len(per_step):.0f} distinct Python functions (mean; {len(calls)} over the {m} steps)"
            )
            mods: collections.Counter[str] = collections.Counter(where(c) for c in calls)
            print("    distinct functions by module: " + ", ".join(f"{k} {v}" for k, v in mods.most_common()))
            if args.list and side == "kvcoord":
                own = sorted(
                    (v / m, f"{where(c)}:{c.co_qualname}") for c, v in calls.items() if "kvcoord" in where(c)
                )
                print("    calls per step: " + ", ".join(f"{q} {v:g}" for v, q in own))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
