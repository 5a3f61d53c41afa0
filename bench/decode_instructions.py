"""Instructions per block operation of the Step path, counted by valgrind (not a test).

    PYTHONPATH=client:server python bench/decode_instructions.py [--running 256] \
        [--shape columnar] [--old REV] [--warmup 600] [--path apply|served]

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

``--path served``: each Step's bytes handed instead to the Step handler the server
registers (``servicer.add_servicer``, wrapped by the metrics interceptor: what a
StepStream runs per message: the guard, the parse, the input bounds, the session, the
idempotency key and its digest, the kept answer, the metrics) and its answer encoded by
the handler's serializer, on an asyncio loop without gRPC (a stub call context,
memory-only registry): the per-Step work of the served path that is kvcoord's, gRPC's
own excepted. The cyclic collector is off there, hashes are seeded the same, the clock
stands still (no lease or kept answer runs out at valgrind's pace) and no
Step is applied in slices (under valgrind every Step outlasts ``slice_seconds``, and
where the clock cut it moved the count by 5-15 % between two runs of one code).
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
from typing import Any

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


def served_child(tree: Path, trace: Path, shape: str, steps: int, warm: int) -> None:
    """``--path served``: the trace's Steps through the registered Step handler chain."""
    sys.path[:0] = [str(tree / "client"), str(tree / "server")]
    import asyncio
    import gc

    import decode_cpu as D
    from common import CallDetails, Registrar, StubContext
    from kvcoord.service.idempotency import IdempotencyStore
    from kvcoord.service.metrics import Metrics
    from kvcoord.service.pool_types import Limits
    from kvcoord.service.registry import PoolRegistry
    from kvcoord.service.servicer import AllocatorServicer, add_servicer
    from kvcoord.service.sessions import SessionTable
    from kvcoord.service.testing import ManualClock
    from kvcoord.v1 import allocator_pb2 as pb

    pool = json.loads(trace.with_suffix(".pool.json").read_text())
    algo, bs, seed = pool["attach"]
    clock = ManualClock()  # (leases and kept answers never run out under valgrind's pace)
    registry = PoolRegistry(
        Limits(), SessionTable(clock, 30, 60), IdempotencyStore(clock, 60, 1 << 30), clock=clock
    )
    metrics = Metrics()
    servicer = AllocatorServicer(registry, metrics)
    servicer.mutations.slice_seconds = 3600.0  # (see the module's docstring)
    metrics.bind(servicer)
    registrar = Registrar()
    interceptor = metrics.interceptor()
    add_servicer(servicer, registrar, [interceptor])  # type: ignore[arg-type]

    async def handler(name: str) -> Any:
        method = f"/kvcoord.v1.Allocator/{name}"

        async def found(_details: Any) -> Any:
            return registrar.handler.service(CallDetails(method))

        return await interceptor.intercept_service(found, CallDetails(method))  # type: ignore[arg-type]

    async def call(h: Any, request: Any) -> Any:
        parse = h.request_deserializer
        data = request.SerializeToString()
        return h.response_serializer(
            await h.unary_unary(data if parse is None else parse(data), StubContext())
        )

    async def run() -> None:
        config = pb.PoolConfig.FromString(bytes.fromhex(pool["config"]))
        await call(await handler("CreatePool"), pb.CreatePoolRequest(name="p", config=config))
        att = pb.AttachResponse.FromString(
            await call(
                await handler("Attach"),
                pb.AttachRequest(
                    pool="p", hash_algo=algo, hash_block_size=bs, hash_seed=seed, client_name="b"
                ),
            )
        )
        step = await handler("Step")
        bodies = D.load(trace)[: warm + HIGH]
        wire = [
            pb.StepRequest(pool="p", session_id=att.session_id, ops=D.shaped(pb, b, shape),
                           idempotency_key=f"{k:032x}").SerializeToString()
            for k, b in enumerate(bodies)
        ]  # fmt: skip
        context = StubContext()
        parse = step.request_deserializer
        gc.collect()
        gc.disable()
        for body in wire[: warm + steps]:
            step.response_serializer(await step.unary_unary(body if parse is None else parse(body), context))

    asyncio.run(run())


def instructions(
    tree: Path, trace: Path, shape: str, steps: int, tmp: Path, warm: int, path: str = "apply"
) -> int:
    out = tmp / "cachegrind.out"
    kind = "child" if path == "apply" else "served"
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
           sys.executable, str(HERE), kind, str(tree), str(trace), shape, str(steps), str(warm)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), PYTHONHASHSEED="0")
    err = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stderr
    m = re.search(r"I\s+refs:\s+([\d,]+)", err)
    assert m is not None, err[-2000:]
    return int(m.group(1).replace(",", ""))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "served":
        served_child(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--shape", default="columnar", choices=["ops", "run", "columnar", "packed"])
    ap.add_argument("--old", help="a git revision to compare against (its client and server)")
    ap.add_argument("--warmup", type=int, default=WARM, help="Steps applied before the counted ones")
    ap.add_argument("--path", default="apply", choices=["apply", "served"], help="see the module's docstring")
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
        diff = instructions(tree, trace, args.shape, HIGH, tmp, warm, args.path) - instructions(
            tree, trace, args.shape, LOW, tmp, warm, args.path
        )
        print(f"{name}: {diff / ops:,.0f} instructions per operation, {diff / (HIGH - LOW):,.0f} per Step "
              f"({args.path}, {args.shape}, {args.running} running; "
              f"{time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
