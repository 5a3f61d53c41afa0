"""Where a served Step's CPU goes beyond its handler. Not a test.

    PYTHONPATH=client:server python bench/step_overhead.py [--running 256] [--steps 500] \
        [--warmup 100] [--parts floor layers]

The Steps are decode_cpu.py's (one workers.py worker's scheduler, ``--running``
requests in decode, the columnar shape: a DecodeOp per run of registered requests).

  floor   gRPC's own cost per call, without kvcoord: a bare ``grpc.aio`` server (a child
          process) answers the recorded Steps' bytes with bytes as long as kvcoord's
          answers, unary (as Step is called) and as messages of one bidirectional
          stream; its process CPU per call (all threads, Linux's process CPU clock).
          The two servers serve at once and each call goes to both in turn.
  layers  in-process, the Python layers gRPC runs around ``Servicer.Step``: the guard
          (credentials, input bounds, role, the pool's slice lock), the metrics
          interceptor's wrapper and the metrics observer, against ``Servicer.Step``
          alone (both: the request parsed from its bytes, the answer serialized); two
          servers fed the same Steps in turns, the loop thread's CPU per Step, and the
          median of their per-Step difference.

A served Step costs about floor + handler + layers (decode_cpu.py's ``grpc`` figure
against its ``in-process`` one).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "client"), str(ROOT / "server")]

import decode_cpu as D  # noqa: E402
from common import CallDetails, Registrar, StubContext  # noqa: E402

_SERVE = "serve"


def serve(answer_bytes: int) -> None:
    """The bare server (child): ``/e.Echo/Unary`` and ``/e.Echo/Stream`` answer every
    request with ``answer_bytes`` zero bytes; prints its port."""
    import grpc

    answer = bytes(answer_bytes)

    async def unary(_request: bytes, _context: Any) -> bytes:
        return answer

    async def stream(requests: Any, _context: Any) -> Any:
        async for _ in requests:
            yield answer

    async def main() -> None:
        server = grpc.aio.server()
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("e.Echo", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def floor(bodies: list[bytes], answer_bytes: int, warmup: int) -> dict[str, float]:
    """µs of server CPU per call, unary and per stream message."""
    import queue

    import grpc

    env = dict(os.environ, PYTHONPATH="")
    procs, calls, closers = {}, {}, []
    try:
        for kind in ("unary", "stream"):
            p = subprocess.Popen(
                [sys.executable, __file__, _SERVE, str(answer_bytes)],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            procs[kind] = p
            assert p.stdout is not None
            channel = grpc.insecure_channel(f"127.0.0.1:{int(p.stdout.readline())}")
            closers.append(channel.close)
            if kind == "unary":
                calls[kind] = channel.unary_unary("/e.Echo/Unary")
            else:
                q: queue.Queue[bytes | None] = queue.Queue()

                def sent(q: queue.Queue[bytes | None] = q) -> Any:
                    while (m := q.get()) is not None:
                        yield m

                answers = channel.stream_stream("/e.Echo/Stream")(sent())
                closers.insert(0, lambda q=q: q.put(None))

                def call(body: bytes, q: queue.Queue[bytes | None] = q, answers: Any = answers) -> Any:
                    q.put(body)
                    return next(answers)

                calls[kind] = call
        cpu0: dict[str, float] = {}
        for k, body in enumerate(bodies):
            if k == warmup:
                cpu0 = {kind: D.server_cpu(p.pid) for kind, p in procs.items()}
            for kind in ("unary", "stream") if k % 2 else ("stream", "unary"):
                calls[kind](body)
        n = len(bodies) - warmup
        return {kind: (D.server_cpu(p.pid) - cpu0[kind]) / n * 1e6 for kind, p in procs.items()}
    finally:
        for close in closers:
            close()
        for p in procs.values():
            p.kill()
            p.wait()


def layers(trace: Path, running: int, warmup: int) -> dict[str, float]:
    """Loop-thread µs per Step of ``Servicer.Step`` alone and of the handler chain."""
    import workers as W
    from kvcoord.client import KVCoordClient
    from kvcoord.service.servicer import add_servicer
    from kvcoord.service.testing import InProcessServer
    from kvcoord.v1 import allocator_pb2 as pb

    bodies = D.load(trace)
    method = "/kvcoord.v1.Allocator/Step"
    sides: dict[str, Any] = {}
    for name in ("step", "chain"):
        srv = InProcessServer(metrics=True).start()  # the metrics observer, as kvcoord serve has
        servicer = srv.running.servicer  # type: ignore[union-attr]
        with KVCoordClient(srv.address, timeout=60) as c:
            c.create_pool("p", W.pool_config(W.worker_blocks(running)))
            att = c.attach("p", W.ALGO, W.BS, W.SEED, "bench")
        wire = [
            pb.StepRequest(pool="p", session_id=att.session_id, ops=D.shaped(pb, b, "columnar"),
                           idempotency_key=f"k{k}").SerializeToString()
            for k, b in enumerate(bodies)
        ]  # fmt: skip
        registrar = Registrar()
        add_servicer(servicer, registrar)  # type: ignore[arg-type]
        handler = registrar.handler.service(CallDetails(method))
        interceptor = srv.metrics.interceptor()  # type: ignore[union-attr]

        async def found(_details: Any, handler: Any = handler) -> Any:
            return handler

        handler = srv._run(interceptor.intercept_service(found, CallDetails(method)))  # type: ignore[arg-type]
        sides[name] = (srv, servicer, wire, handler)
    cpu: dict[str, list[float]] = {"step": [], "chain": []}
    answers: dict[str, list[bytes]] = {"step": [], "chain": []}

    async def one(name: str, k: int) -> None:
        _, servicer, wire, handler = sides[name]
        t0 = time.thread_time()
        if name == "step":
            answer = await servicer.Step(pb.StepRequest.FromString(wire[k]), None)
            body = answer if type(answer) is bytes else answer.SerializeToString()
        else:
            parse = handler.request_deserializer  # (None: the handler parses the bytes itself)
            answer = await handler.unary_unary(wire[k] if parse is None else parse(wire[k]), StubContext())
            body = handler.response_serializer(answer)
        cpu[name].append(time.thread_time() - t0)
        answers[name].append(body)

    try:
        for k in range(len(bodies)):
            for name in ("step", "chain") if k % 2 else ("chain", "step"):
                sides[name][0]._run(one(name, k), 60)
    finally:
        for srv, *_ in sides.values():
            srv.stop()
    blocks = {n: [D.new_blocks(pb.StepResponse.FromString(a)) for a in xs] for n, xs in answers.items()}
    if blocks["step"] != blocks["chain"]:
        raise RuntimeError("the handler chain answered other blocks than Servicer.Step")
    step, chain = cpu["step"][warmup:], cpu["chain"][warmup:]
    return {
        "step": statistics.median(step) * 1e6,
        "chain": statistics.median(chain) * 1e6,
        "difference": statistics.median(c - s for c, s in zip(chain, step, strict=True)) * 1e6,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == _SERVE:
        serve(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=500, help="measured Steps")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--parts", nargs="+", default=["floor", "layers"], choices=["floor", "layers"])
    args = ap.parse_args()
    from kvcoord.v1 import allocator_pb2 as pb

    trace = Path(tempfile.mkdtemp(prefix="kvcoord-step-overhead-")) / "trace.bin"
    D.build(args.running, args.warmup + args.steps, trace)
    bodies = D.load(trace)
    wire = [
        pb.StepRequest(pool="p", session_id="s" * 32, ops=D.shaped(pb, b, "columnar"), idempotency_key="k" * 32)
        .SerializeToString()
        for b in bodies
    ]  # fmt: skip
    print(
        f"{args.running} running, {args.steps} measured Steps, request {statistics.fmean(map(len, wire)):.0f} B"
    )
    if "floor" in args.parts:
        answer = 600 if args.running >= 128 else 200  # about kvcoord's decode answers
        f = floor(wire, answer, args.warmup)
        print(f"floor (bare grpc.aio, {answer} B answers): unary {f['unary']:.0f} µs/call, "
              f"one stream's message {f['stream']:.0f} µs")  # fmt: skip
    if "layers" in args.parts:
        r = layers(trace, args.running, args.warmup)
        print(f"layers: Servicer.Step alone {r['step']:.0f} µs/Step, with the handler chain {r['chain']:.0f}: "
              f"+{r['difference']:.0f} µs (median per-Step difference)")  # fmt: skip
    print("load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
