"""Wire benchmark: the same decode steps in-process, one unary RPC per operation, and one
Step RPC per scheduler step, side by side. Not a test.

    python bench/wire.py [--requests 256] [--steps 20]

A server process is started on loopback (kvcoord.client.testing). Each of 256 requests
is prefilled, then every scheduler step allocates one decode token for every request.
Prints microseconds per allocate and the ratio to the in-process engine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.hashing import BlockHasher, none_hash  # noqa: E402
from kvcoord.client.testing import start_server  # noqa: E402
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

BS = 16
NONE = none_hash("sha256_cbor", "0")


def prompts(n: int) -> list[list[int]]:
    return [[(i * 7919 + j) % 32000 for j in range(512)] for i in range(n)]


def pool_config(num_blocks: int) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))],
        hash_block_size=BS, enable_caching=True, hash_algo="sha256_cbor", hash_seed="0", max_model_len=8192,
    )  # fmt: skip


def bench_engine(ps: list[list[int]], steps: int) -> float:
    pool = KVCachePool(KVCacheConfig(num_blocks=len(ps) * 64, groups=(FullAttentionSpec(BS),), hash_block_size=BS,
                                     max_model_len=8192))  # fmt: skip
    hashers = {}
    for i, p in enumerate(ps):
        hashers[i] = BlockHasher("sha256_cbor", BS, NONE)
        pool.add_request(f"r{i}", p, hashers[i].extend(p))
        pool.allocate_slots(f"r{i}", len(p))
    samples = []
    for s in range(steps):
        t0 = time.perf_counter()
        for i, p in enumerate(ps):
            n = len(p) + s
            pool.update_request(f"r{i}", num_computed_tokens=n, append_token_ids=[s],
                                append_block_hashes=hashers[i].extend([s]))  # fmt: skip
            pool.allocate_slots(f"r{i}", 1)
        samples.append((time.perf_counter() - t0) / len(ps))
    return statistics.median(samples) * 1e6


def _sync(i: int, p: list[int], s: int, hasher: BlockHasher) -> pb.RequestSync:
    return pb.RequestSync(request_id=f"r{i}", append_token_ids=[s], append_block_hashes=hasher.extend([s]),
                          num_computed_tokens=len(p) + s)  # fmt: skip


def bench_wire(address: str, ps: list[list[int]], steps: int, batched: bool) -> float:
    name = f"wire-{'step' if batched else 'unary'}"
    with KVCoordClient(address, timeout=60) as c:
        c.create_pool(name, pool_config(len(ps) * 64))
        hashers = {}
        prefill = []
        for i, p in enumerate(ps):
            hashers[i] = BlockHasher("sha256_cbor", BS, NONE)
            sync = pb.RequestSync(
                request_id=f"r{i}", append_token_ids=p, append_block_hashes=hashers[i].extend(p)
            )
            prefill.append(pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=len(p))))
        c.step(name, prefill)
        samples = []
        for s in range(steps):
            ops = [pb.Operation(allocate=pb.AllocateOp(request=_sync(i, p, s, hashers[i]), num_new_tokens=1))
                   for i, p in enumerate(ps)]  # fmt: skip
            t0 = time.perf_counter()
            if batched:
                resp = c.step(name, ops)
                assert all(r.status_code == 0 for r in resp.results)
            else:
                for op in ops:
                    c.allocate(name, op.allocate)
            samples.append((time.perf_counter() - t0) / len(ps))
        c.delete_pool(name)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    ps = prompts(args.requests)
    server = start_server("")
    try:
        engine = bench_engine(ps, args.steps)
        unary = bench_wire(server.address, ps, args.steps, batched=False)
        step = bench_wire(server.address, ps, args.steps, batched=True)
    finally:
        server.stop()
    print(
        f"{args.requests} requests, {args.steps} decode steps, median per allocate (update + allocate_slots):"
    )
    print(f"{'path':<34}{'us/alloc':>10}{'x engine':>10}")
    for label, v in (("in-process engine", engine), ("unary Allocate RPC per request", unary),
                     (f"one Step RPC per step ({args.requests} ops)", step)):  # fmt: skip
        print(f"{label:<34}{v:>10.1f}{v / engine:>10.1f}")
    print(f"Step batching is {unary / step:.1f}x cheaper per allocation than unary calls")


if __name__ == "__main__":
    main()
