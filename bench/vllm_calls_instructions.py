"""Instructions per KVCacheManager call on vLLM's scheduler pattern: vLLM's own manager
against kvcoord's predicted one (``KVCoordScheduler``, ``KVCOORD_PREDICT=1``), counted
by valgrind (not a test): a load-independent companion of ``bench/vllm_calls.py``,
whose CPU times move by tens of percent with other jobs on a shared machine.

    KVCOORD_VENV=$(scripts/install_vllm.sh --print-venv)
    PYTHONPATH=client:server:tests PYTHONHASHSEED=0 $KVCOORD_VENV/bin/python bench/vllm_calls_instructions.py \\
        [--running 256] [--warmup 150] [--steps 40] [--side both|vllm|kvcoord]

The workload is ``bench/vllm_step.py``'s (as ``bench/vllm_calls.py`` runs it), one
scheduler per valgrind run (``--tool=callgrind``, instrumentation off until the
``--warmup`` steps are done). Each manager method the scheduler calls is called, in the
measured steps, through a C function of its own (a tiny extension built here with the
valgrind headers), whose inclusive instructions callgrind counts on the calling thread
only: per call kind, the instructions of all its calls (the sender thread's work in
between is not counted, the GIL hand-over a call pays is). ``allocate_slots`` is split
as in ``bench/vllm_calls.py``: a waiting request's first allocation, a running
request's step inside its blocks or taking blocks (told before the call, by whether the
step's tokens cross a block boundary; the answer checks it, and the count of calls told
wrongly is printed). ``schedule`` and ``update_from_output`` are counted whole too.
The cyclic garbage collector is off in the measured steps (heap frozen first), unless
``--keep-gc``: where a collection falls moved one call kind's mean by thousands of
instructions between two runs of the same code.

``--model-touch-mb M`` with ``--cache-sim`` and a small last-level cache
(``--valgrind-arg=--LL=2097152,16,64``): the model's run writes M MiB first, so every
step starts with cold caches (as after a real model's run, or other processes on the
core), and a call's last-level misses count the memory lines it touches: the footprint
a step pays for in cache misses, which its instructions do not show.

kvcoord's server runs outside valgrind (started here), as in ``bench/vllm_calls.py``.
About 5-10 minutes per side at 256 running.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: the call kinds, each counted through a C function of its own
KINDS = (
    "get_computed_blocks",
    "alloc_first",
    "alloc_inside",
    "alloc_taking",
    "free",
    "take_events",
    "make_prefix_cache_stats",
    "get_blocks",
    "schedule",
    "update_from_output",
    "noop",
)
#: generic marks for ``--detail`` (one per function named there)
DETAIL_MARKS = tuple(f"d{i}" for i in range(32))

_C = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <valgrind/callgrind.h>

static PyObject *call_through(PyObject *args, PyObject *kwargs) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1) { PyErr_SetString(PyExc_TypeError, "a callable first"); return NULL; }
    PyObject *rest = PyTuple_GetSlice(args, 1, n);
    if (rest == NULL) return NULL;
    PyObject *out = PyObject_Call(PyTuple_GET_ITEM(args, 0), rest, kwargs);
    Py_DECREF(rest);
    return out;
}
%(funcs)s
static PyObject *kvmark_start(PyObject *self, PyObject *unused) {
    CALLGRIND_START_INSTRUMENTATION;
    CALLGRIND_ZERO_STATS;
    Py_RETURN_NONE;
}
static PyObject *kvmark_stop(PyObject *self, PyObject *unused) {
    CALLGRIND_STOP_INSTRUMENTATION;
    Py_RETURN_NONE;
}
static PyMethodDef methods[] = {
%(table)s
    {"start", kvmark_start, METH_NOARGS, NULL},
    {"stop", kvmark_stop, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL}
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmark", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kvmark(void) { return PyModule_Create(&module); }
"""


def build_marks(out: Path) -> None:
    """Build the ``kvmark`` extension into ``out`` (one C function per call kind)."""
    funcs = "\n".join(
        f"__attribute__((noinline)) static PyObject *kvmark_{k}(PyObject *self, PyObject *args, PyObject *kw)"
        " { return call_through(args, kw); }"
        for k in KINDS + DETAIL_MARKS
    )
    table = "\n".join(f'    {{"{k}", (PyCFunction)(void(*)(void))kvmark_{k}, METH_VARARGS | METH_KEYWORDS, NULL}},'
                      for k in KINDS + DETAIL_MARKS)  # fmt: skip
    src = out / "kvmark.c"
    src.write_text(_C % {"funcs": funcs, "table": table})
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(
        ["gcc", "-O1", "-fPIC", "-shared", f"-I{sysconfig.get_paths()['include']}", str(src),
         "-o", str(out / f"kvmark{suffix}")],
        check=True,
    )  # fmt: skip


# -- the child: one scheduler under valgrind ------------------------------------------------


def child(
    side: str,
    running: int,
    warmup: int,
    steps: int,
    marks: str,
    detail: list[str],
    keep_gc: bool,
    model_ms: float = 0.0,
    model_touch_mb: int = 0,
) -> None:
    sys.path[:0] = [marks, str(ROOT / "bench"), str(ROOT / "tests" / "with_vllm")]
    import kvmark  # type: ignore[import-not-found]
    from harness import BLOCK_SIZE, SCHEDULERS, kv_cache_config, make_scheduler, vllm_config, write_model_dir
    from kvcoord.client.vllm_scheduler import KVCoordScheduler
    from vllm_step import MODEL_TOUCHES, run

    MODEL_TOUCHES.extend(bytes(model_touch_mb << 20))  # (written at each model run's start)

    model = write_model_dir(Path(tempfile.mkdtemp(prefix="kvcoord-bench-model-")))
    blocks = running * (900 + 128) // BLOCK_SIZE * 2 + 64
    config = vllm_config(
        model, blocks, async_scheduling=False, max_num_seqs=running, max_num_batched_tokens=8192
    )
    cls = SCHEDULERS["sync"] if side == "vllm" else KVCoordScheduler
    sched = make_scheduler(cls, config, kv_cache_config("full", blocks))
    manager = sched.kv_cache_manager
    on = False
    calls: dict[str, int] = dict.fromkeys(KINDS, 0)
    wrong = 0

    def wrap(obj: Any, name: str, kind: str | None) -> None:
        inner = getattr(obj, name)
        mark_of = {k: getattr(kvmark, k) for k in KINDS}

        def marked(*args: Any, **kwargs: Any) -> Any:
            nonlocal wrong
            if not on:
                return inner(*args, **kwargs)
            k = kind
            if k is None:  # allocate_slots: which path, told before the call
                if len(args) > 2 or any(a != "num_lookahead_tokens" for a in kwargs):
                    k = "alloc_first"
                else:
                    req, new = args[0], args[1]
                    done = req.num_computed_tokens
                    end = done + new + kwargs.get("num_lookahead_tokens", 0)
                    k = "alloc_taking" if -(-end // BLOCK_SIZE) > -(-done // BLOCK_SIZE) else "alloc_inside"
            calls[k] += 1
            out = mark_of[k](inner, *args, **kwargs)
            if k in ("alloc_inside", "alloc_taking") and out is not None:
                if (k == "alloc_taking") != any(out.get_block_ids()):
                    wrong += 1
            return out

        setattr(obj, name, marked)

    wrap(manager, "allocate_slots", None)
    for name in ("get_computed_blocks", "free", "take_events", "make_prefix_cache_stats", "get_blocks"):
        wrap(manager, name, name)
    wrap(sched, "schedule", "schedule")
    wrap(sched, "update_from_output", "update_from_output")
    # --detail: functions inside the calls, each through a mark of its own (path from the manager)
    for i, dotted in enumerate(detail):
        *path, attr = dotted.split(".")
        obj: Any = manager
        if path[:1] == ["sched"]:  # from the scheduler instead (its own methods)
            obj, path = sched, path[1:]
        for part in path:
            obj = getattr(obj, part)
        inner_d, mark_d = getattr(obj, attr), getattr(kvmark, DETAIL_MARKS[i])

        def marked_d(
            *args: Any, _i: Any = inner_d, _m: Any = mark_d, _k: str = DETAIL_MARKS[i], **kw: Any
        ) -> Any:
            if not on:
                return _i(*args, **kw)
            calls[_k] = calls.get(_k, 0) + 1
            return _m(_i, *args, **kw)

        try:
            setattr(obj, attr, marked_d)
        except (AttributeError, TypeError):
            print(f"--detail: {dotted} cannot be wrapped", file=sys.stderr)
    done = 0

    def between() -> None:
        nonlocal on, done
        done += 1
        if done == warmup:
            if not keep_gc:  # (where a collection falls would move a call kind's count by thousands)
                gc.collect()
                gc.freeze()
                gc.disable()
            on = True
            kvmark.start()
            for _ in range(100):  # the marks' own cost (a C call of a C callable)
                kvmark.noop(int)
            calls["noop"] = 100

    run(sched, running, warmup + steps, seed=running, counter=None, between=between, model_s=model_ms / 1e3)
    on = False
    # (every thread's counts end with the measured steps: the shutdown's are not theirs;
    # the last step's Step was sent and answered inside its model run)
    kvmark.stop()
    if side != "vllm":
        sched.shutdown()
    print("KVMARK " + json.dumps({"calls": calls, "wrong": wrong}), flush=True)


# -- the parent -----------------------------------------------------------------------------


def inclusive(path: Path) -> dict[str, int]:
    """Inclusive instructions of each ``kvmark_*`` function in a callgrind output file
    (its own cost plus the cost of the calls it made)."""
    return {k: v[0] for k, v in inclusive_events(path)[1].items()}


def inclusive_events(path: Path) -> tuple[list[str], dict[str, list[int]]]:
    """:func:`inclusive` of every event the file counts (``Ir`` first; with
    ``--cache-sim=yes`` also data reads/writes and L1/last-level misses): the event
    names and, per ``kvmark_*`` function, one inclusive count per event."""
    names: dict[str, str] = {}
    totals: dict[str, list[int]] = {}
    events: list[str] = ["Ir"]
    current: str | None = None
    name_re = re.compile(r"^\((\d+)\)(?: (.*))?$")

    def resolve(ref: str) -> str:
        m = name_re.match(ref.strip())
        if not m:
            return ref.strip()
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), ref)

    with path.open() as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("fn="):
                name = resolve(line[3:])
                current = name if name.startswith("kvmark_") else None
            elif line.startswith("cfn="):
                resolve(line[4:])
            elif current is not None and (line[:1].isdigit() or line[:1] in "+-*"):
                # a cost line: the function's own, or (after ``calls=``) a call's inclusive
                parts = line.split()
                if len(parts) >= 2:
                    row = totals.setdefault(current, [0] * len(events))
                    for i, v in enumerate(parts[1 : 1 + len(events)]):
                        row[i] += int(v)
    return events, totals


def thread_totals(path: Path) -> list[int]:
    """A callgrind output file's ``totals:`` line (one count per event: the whole thread)."""
    with path.open() as f:
        for line in f:
            if line.startswith("totals:"):
                return [int(v) for v in line.split()[1:]]
    return []


def run_side(side: str, args: argparse.Namespace, marks: Path, tmp: Path) -> dict[str, Any]:
    sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]
    from kvcoord.client.testing import start_server

    env = dict(os.environ, PYTHONHASHSEED="0")
    server = None
    if side == "kvcoord":
        path = ":".join([str(ROOT / "client"), str(ROOT / "server")])
        # (on a loaded machine the server took over 30 s to start, and a call made from
        # inside valgrind, CreatePool, passed the client's 10 s deadline: neither bounds
        # what is counted)
        server = start_server("", env=dict(env, PYTHONPATH=path), startup_timeout=600.0)
        env.setdefault("KVCOORD_TIMEOUT", "300")
        env.update(KVCOORD_TARGET=server.address, KVCOORD_PREDICT="1", KVCOORD_POOL="bench-calls")
    out = tmp / f"callgrind.{side}.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           *(["--cache-sim=yes"] if args.cache_sim else []),
           *(["--separate-threads=yes"] if args.threads else []), *args.valgrind_arg,
           sys.executable, str(Path(__file__).resolve()), "--child", side, "--running", str(args.running),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--marks", str(marks),
           "--detail", args.detail, "--model-ms", str(args.model_ms), "--model-touch-mb", str(args.model_touch_mb),
           *(["--keep-gc"] if args.keep_gc else [])]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    finally:
        if server is not None:
            server.stop()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("KVMARK ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(
            f"{side}: valgrind run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    info = json.loads(line[len("KVMARK ") :])
    if args.threads:
        # one file per thread: the marks (the scheduler's calls) are thread 1's; every
        # other thread's totals are work done beside them in the measured steps
        files = sorted(tmp.glob(f"callgrind.{side}.out-*"))
        info["threads"] = {f.name.rsplit("-", 1)[1]: thread_totals(f) for f in files}
        out = tmp / f"callgrind.{side}.out-01"
    events, totals = inclusive_events(out)
    info["ir"] = {k[len("kvmark_") :]: v[0] for k, v in totals.items()}
    info["events"] = events
    info["all"] = {k[len("kvmark_") :]: v for k, v in totals.items()}
    print(f"{side}: callgrind output {out}", flush=True)
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--side", default="both", choices=["both", "vllm", "kvcoord"])
    ap.add_argument("--json", help="write the counts to this file too")
    ap.add_argument(
        "--detail",
        default="",
        help="comma-separated functions (dotted from the manager, or from the scheduler: sched.NAME) to count too",
    )
    ap.add_argument(
        "--keep-gc",
        action="store_true",
        help="the cyclic collector stays on in the measured steps (off by default)",
    )
    ap.add_argument(
        "--cache-sim",
        action="store_true",
        help="valgrind's cache simulation too: data accesses and L1 / last-level misses per call",
    )
    ap.add_argument(
        "--model-ms",
        type=float,
        default=0.0,
        help="the model's time between schedule() and update_from_output() (a sleep, the GIL released, as "
        "bench/vllm_step.py --model-ms): kvcoord's sender thread sends the Step meanwhile instead of "
        "taking the GIL from update_from_output (under valgrind its work is ~50x slower: give it room)",
    )
    ap.add_argument(
        "--model-touch-mb",
        type=int,
        default=0,
        help="the model's run writes this many MiB first (as bench/vllm_step.py --model-touch-mb): with "
        "--cache-sim and a last-level cache smaller than that (--valgrind-arg=--LL=2097152,16,64), every "
        "step starts with cold caches, and its last-level misses count the memory lines it touches",
    )
    ap.add_argument(
        "--valgrind-arg",
        action="append",
        default=[],
        help="one more valgrind option (repeatable), e.g. --valgrind-arg=--toggle-collect=kvmark_update_from_output "
        "to keep only that call's costs, per C function, for callgrind_annotate (the output file is printed)",
    )
    ap.add_argument(
        "--threads",
        action="store_true",
        help="one valgrind output per thread (--separate-threads=yes): the calls are counted on the "
        "scheduler's thread as without it, and each other thread's whole work in the measured steps is "
        "printed per step (with --cache-sim: the lines it brings into the one cache valgrind simulates "
        "for all of a process's threads, as if they ran on the scheduler's core)",
    )
    ap.add_argument("--child", choices=["vllm", "kvcoord"], help=argparse.SUPPRESS)
    ap.add_argument("--marks", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(
            args.child,
            args.running,
            args.warmup,
            args.steps,
            args.marks,
            [d for d in args.detail.split(",") if d],
            args.keep_gc,
            args.model_ms,
            args.model_touch_mb,
        )
        return
    tmp = Path(tempfile.mkdtemp(prefix="kvcoord-calls-ir-"))
    build_marks(tmp)
    sides = ["vllm", "kvcoord"] if args.side == "both" else [args.side]
    got = {s: run_side(s, args, tmp, tmp) for s in sides}
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    print(f"{args.running} running, {args.steps} steps after {args.warmup}: instructions per call")
    print(
        f"{'call':<26}"
        + "".join(f"{s + ' calls':>14}{s + ' Ir':>14}" for s in sides)
        + ("      x" if len(sides) == 2 else "")
    )
    for k in KINDS:
        row, per = f"{k:<26}", []
        for s in sides:
            n, ir = got[s]["calls"].get(k, 0), got[s]["ir"].get(k, 0)
            per.append(ir / n if n else 0.0)
            row += f"{n:>14}{per[-1]:>14.0f}"
        if len(per) == 2 and per[0]:
            row += f"{per[1] / per[0]:>7.2f}"
        print(row)
    for i, dotted in enumerate(d for d in args.detail.split(",") if d):
        k = DETAIL_MARKS[i]
        row = f"{dotted:<40}"
        for s in sides:
            n, ir = got[s]["calls"].get(k, 0), got[s]["ir"].get(k, 0)
            row += f"{n:>10}{ir / n if n else 0:>12.0f}"
        print(row)
    if args.cache_sim:
        print_misses(got, sides, [d for d in args.detail.split(",") if d])
    if args.threads:
        print_threads(got, sides, args.steps)
    for s in sides:
        print(f"{s}: allocations told wrongly inside/taking: {got[s]['wrong']}")


def print_threads(got: dict[str, Any], sides: list[str], steps: int) -> None:
    """Per thread, per measured step: instructions and (with ``--cache-sim``)
    last-level misses, the scheduler's thread (1) first (``--threads``)."""
    print("per thread, a measured step: Ir, LL misses (ILmr+DLmr+DLmw; 1: the scheduler's thread)")
    for s in sides:
        ev = got[s]["events"]
        others_ir = others_ll = 0.0
        for tid, v in sorted(got[s]["threads"].items()):
            row = dict(zip(ev, v, strict=False))
            ir = row.get("Ir", 0) / steps
            ll = sum(row.get(x, 0) for x in ("ILmr", "DLmr", "DLmw")) / steps
            if tid != "01":
                others_ir, others_ll = others_ir + ir, others_ll + ll
            if ir >= 1000:
                print(f"{s:>8} thread {int(tid):>3}{ir:>14.0f}{ll:>10.0f}")
        print(f"{s:>8} others    {others_ir:>14.0f}{others_ll:>10.0f}")


def print_misses(got: dict[str, Any], sides: list[str], detail: list[str]) -> None:
    """Per call kind (and per ``--detail`` function): data reads and writes, L1 data
    misses and last-level misses (instruction and data) per call, each side (``--cache-sim``)."""
    print("per call: Dr+Dw (data accesses), D1 misses (D1mr+D1mw), I1 misses, LL misses (ILmr+DLmr+DLmw)")
    print(f"{'call':<26}" + "".join(f"{s + ' D':>14}{'D1m':>9}{'I1m':>8}{'LLm':>7}" for s in sides))
    for k, name in [(k, k) for k in KINDS] + list(zip(DETAIL_MARKS, detail, strict=False)):
        row = f"{name:<26}"
        for s in sides:
            ev, n = got[s]["events"], got[s]["calls"].get(k, 0)
            v = dict(zip(ev, got[s]["all"].get(k, [0] * len(ev)), strict=True))

            def per(*names: str, _v: dict[str, int] = v, _n: int = n) -> float:
                return sum(_v.get(x, 0) for x in names) / _n if _n else 0.0

            row += f"{per('Dr', 'Dw'):>14.0f}{per('D1mr', 'D1mw'):>9.0f}{per('I1mr'):>8.0f}"
            row += f"{per('ILmr', 'DLmr', 'DLmw'):>7.0f}"
        print(row)


if __name__ == "__main__":
    main()
