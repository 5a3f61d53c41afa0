"""gRPC's own server CPU per streamed message (Python aio), with no kvcoord code. Not a test.

    python bench/stream_floor.py [--messages 5000] [--request-bytes 16384] [--answer-bytes 2048]

A child process serves one bidirectional-streaming method whose handler answers each
request (bytes) at once with a fixed answer (bytes), exactly as StepStream's loop does
(an async generator reading gRPC's request iterator); the parent sends the messages on
one stream, one at a time, each after the last answer. Prints the child's CPU (Linux's
process CPU clock, all threads) per message: the floor under kvcoord's streamed Step
(bench/stream_threads.py) that no change to kvcoord's handler can remove.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import grpc

METHOD = "/floor.Floor/Stream"


async def serve(answer_bytes: int) -> None:
    answer = b"a" * answer_bytes

    async def stream(requests, _context):  # type: ignore[no-untyped-def]
        async for _ in requests:
            yield answer

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "floor.Floor", {"Stream": grpc.stream_stream_rpc_method_handler(stream)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.stop(None)


def cpu(pid: int) -> float:
    return time.clock_gettime_ns((~pid << 3) | 2) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--request-bytes", type=int, default=16384)
    ap.add_argument("--answer-bytes", type=int, default=2048)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.answer_bytes))
        return
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--answer-bytes", str(args.answer_bytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline())
        request = os.urandom(args.request_bytes)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(METHOD)
            import queue

            q: queue.Queue[bytes | None] = queue.Queue()

            def gen():  # type: ignore[no-untyped-def]
                while (item := q.get()) is not None:
                    yield item

            answers = call(gen())
            for k in range(args.warmup + args.messages):
                if k == args.warmup:
                    c0, t0 = cpu(child.pid), time.perf_counter()
                q.put(request)
                next(answers)
            used, wall = cpu(child.pid) - c0, time.perf_counter() - t0
            q.put(None)
        child.stdin.close()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{args.messages} messages of {args.request_bytes} B answered with {args.answer_bytes} B on one stream; "
        f"server {used / args.messages * 1e6:.1f} µs CPU/message, wall {wall / args.messages * 1e6:.1f} µs/message; "
        f"load average {load}"
    )


if __name__ == "__main__":
    main()
