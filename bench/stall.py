"""How long a small call on one pool waits while a huge pool is created and deleted on
another (the server runs every pool on one event loop).

    python bench/stall.py [--blocks 5000000] [--rounds 3]

Prints p50 / p99 / max latency of GetStats on a small pool, measured by a client
thread, first with nothing else happening, then while another client creates and
deletes a pool of --blocks blocks, --rounds times, side by side in one run.
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


def probe(address: str, stop: threading.Event, out: list[float]) -> None:
    with KVCoordClient(address) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get_stats("small")
            out.append(time.perf_counter() - t0)
            time.sleep(0.002)


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
        stop = threading.Event()
        t = threading.Thread(target=probe, args=(server.address, stop, busy))
        t.start()
        cfg = pb.PoolConfig(
            num_blocks=args.blocks,
            groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=16))],
            hash_block_size=16,
        )
        create, delete = [], []
        with KVCoordClient(server.address, timeout=120) as c:
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                c.create_pool("huge", cfg)
                create.append(time.perf_counter() - t0)
                time.sleep(0.2)
                t0 = time.perf_counter()
                c.delete_pool("huge")
                delete.append(time.perf_counter() - t0)
                time.sleep(0.2)
        stop.set()
        t.join()
        print(f"GetStats on 'small', idle server:          {summary(quiet)}")
        print(
            f"GetStats on 'small', {args.blocks:,}-block pool created+deleted x{args.rounds}: {summary(busy)}"
        )
        print(f"CreatePool {args.blocks:,} blocks: " + ", ".join(f"{x * 1e3:.1f} ms" for x in create))
        print(f"DeletePool {args.blocks:,} blocks: " + ", ".join(f"{x * 1e3:.1f} ms" for x in delete))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
