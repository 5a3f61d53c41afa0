"""Memory across pools created, used, frozen out of the collector and deleted. Not a test.

    PYTHONPATH=client:server python bench/pool_churn.py [--cycles 8] [--requests 256] [--tokens 1000]

Each cycle creates a pool (20,000 blocks of 16 tokens, caching and events on), registers
``--requests`` requests of ``--tokens`` tokens in Steps of 64, freezes what is alive as
the server's own freezes do (``gc.collect(1); gc.freeze()``: gc_freezer.GcFreezer, a Step
applied in slices), deletes the pool and waits for its sliced teardown. It prints the
process's resident memory after each cycle: flat when a deleted pool is given back.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "service"))

from helpers import allocate, attach  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.service.testing import InProcessServer  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

BS = 16


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1000)
    args = ap.parse_args()
    cfg = pb.PoolConfig(
        num_blocks=20_000,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))],
        hash_block_size=BS,
        enable_caching=True,
        enable_kv_cache_events=True,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )
    server = InProcessServer().start()
    seen = []
    try:
        with KVCoordClient(server.address, timeout=60) as c:
            for _ in range(args.cycles):
                c.create_pool("churn", cfg)
                sid, fence = attach(c, "churn", block_size=BS)
                for first in range(0, args.requests, 64):
                    ops = []
                    for i in range(first, min(first + 64, args.requests)):
                        prompt = list(range(i * 100_000, i * 100_000 + args.tokens))
                        ops.append(allocate(f"r{i}", prompt, args.tokens, block_size=BS))
                    c.step("churn", ops, sid, fence)
                server.call(lambda: (gc.collect(1), gc.freeze()))
                c.delete_pool("churn")
                server.settle()
                gc.collect()
                seen.append(rss_mb())
    finally:
        server.stop()
        gc.unfreeze()
    print("resident MB after each cycle:", ", ".join(f"{m:.0f}" for m in seen))
    print(f"growth per cycle after the first: {(seen[-1] - seen[0]) / max(1, len(seen) - 1):.1f} MB")


if __name__ == "__main__":
    main()
