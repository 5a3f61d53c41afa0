"""How long a small call on one pool waits while a huge pool is created and deleted on
another (the server runs every pool on one event loop).

    python bench/stall.py [--blocks 5000000] [--rounds 3]

Prints p50 / p99 / max latency of GetStats on a small pool, measured by a client
thread, first with nothing else happening, then while another client creates a pool
of --blocks blocks, fills it (every block used by a few huge requests), and deletes
it, --rounds times, side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from kvcoord.client import KVCoordClient
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb

SMALL = """
[[pools]]
name = "small"
num_blocks = 1024
hash_block_size = 16
[[pools.groups]]
type = "full"
block_size = 16
"""


def probe(address: str, stop: threading.Event, out: list[float], at: list[float] | None = None) -> None:
    with KVCoordClient(address) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get_stats("small")
            out.append(time.perf_counter() - t0)
            if at is not None:
                at.append(t0)
            time.sleep(0.002)


def window(samples: list[float], at: list[float], spans: list[tuple[float, float]]) -> list[float]:
    """The samples that started inside one of ``spans``."""
    return [x for x, t in zip(samples, at, strict=True) if any(a <= t <= b for a, b in spans)]


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return f"n={len(xs):5d} p50={statistics.median(xs) * 1e3:7.2f} ms p99={p99 * 1e3:8.2f} ms max={xs[-1] * 1e3:8.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=5_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    server = InProcessServer(SMALL, limits=Limits(max_blocks_per_pool=args.blocks + 1)).start()
    try:
        quiet: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=probe, args=(server.address, stop, quiet))
        t.start()
        time.sleep(2.0)
        stop.set()
        t.join()
        busy: list[float] = []
        at: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=probe, args=(server.address, stop, busy, at))
        t.start()
        cfg = pb.PoolConfig(
            num_blocks=args.blocks,
            groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=16))],
            hash_block_size=16,
            max_model_len=0,
        )
        create, fill, delete = [], [], []
        create_spans, fill_spans, delete_spans = [], [], []
        per_request = 100_000  # blocks per request; a few requests use the whole pool
        with KVCoordClient(server.address, timeout=600) as c:
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                c.create_pool("huge", cfg)
                create.append(time.perf_counter() - t0)
                create_spans.append((t0 - 0.05, time.perf_counter() + 0.05))
                sid = c.attach("huge", "", 16, "").session_id
                t0 = time.perf_counter()
                for i in range((args.blocks - 1) // per_request):
                    sync = pb.RequestSync(
                        request_id=f"r{i}", append_token_ids=[1] * (per_request * 16), new_request=True
                    )
                    c.step(
                        "huge",
                        [pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=per_request * 16))],
                        sid,
                    )
                fill.append(time.perf_counter() - t0)
                fill_spans.append((t0, time.perf_counter()))
                time.sleep(0.2)
                t0 = time.perf_counter()
                c.delete_pool("huge")
                delete.append(time.perf_counter() - t0)
                time.sleep(1.0)  # the teardown runs on the loop in slices meanwhile
                delete_spans.append((t0, time.perf_counter()))
        stop.set()
        t.join()
        n = f"{args.blocks:,}-block pool"
        print(f"GetStats on 'small', idle server:              {summary(quiet)}")
        print(f"  while a {n} is created: {summary(window(busy, at, create_spans))}")
        print(f"  while it is deleted (+1 s of teardown):         {summary(window(busy, at, delete_spans))}")
        print(f"  while it is filled (100,000-block allocations): {summary(window(busy, at, fill_spans))}")
        print("CreatePool: " + ", ".join(f"{x * 1e3:.1f} ms" for x in create))
        print("Filling it over the wire: " + ", ".join(f"{x:.1f} s" for x in fill))
        print("DeletePool of the used pool: " + ", ".join(f"{x * 1e3:.1f} ms" for x in delete))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
