"""What a decode step's promised allocations cost over the wire. Not a test.

    python bench/decode.py [--running 256] [--steps 60]

One exclusive RemoteKVCacheManager on a server process on loopback keeps N requests
(prompts 512-4,096 tokens) in decode: every step appends one token to each request,
calls allocate_slots(request, 1) for each (all answered at once: promised), then sends
the Step (flush) and reads every block id. Prints the medians of: building the N
promised allocations in the client, the flush (round trip, the server's work and the
answer's decoding), reading the ids, and a no-op Step round trip.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from kvcoord.client import KVCoordClient, RemoteKVCacheManager  # noqa: E402
from kvcoord.client.hashing import BlockHasher, none_hash  # noqa: E402
from kvcoord.client.testing import start_server  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

BS = 16


@dataclasses.dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    hasher: BlockHasher
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    server = start_server("")
    try:
        client = KVCoordClient(server.address, timeout=60)
        client.create_pool("decode", pb.PoolConfig(
            num_blocks=args.running * 300, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))],
            hash_block_size=BS, enable_caching=True, enable_kv_cache_events=True, hash_algo="sha256_cbor",
            hash_seed="0"))  # fmt: skip
        m = RemoteKVCacheManager(client, "decode", hash_seed="0", exclusive=True)
        none = none_hash("sha256_cbor", "0")
        rnd = random.Random(1)
        reqs = []
        for i in range(args.running):
            tokens = [rnd.randrange(32000) for _ in range(rnd.randint(512, 4096))]
            h = BlockHasher("sha256_cbor", BS, none)
            reqs.append(Req(f"r{i}", tokens, h, 0, h.extend(tokens)))
        for r in reqs:
            m.allocate_slots(r, len(r.all_token_ids))
            r.num_computed_tokens = len(r.all_token_ids)
        m.flush()
        build, flush, read = [], [], []
        for _ in range(args.steps):
            for r in reqs:
                t = rnd.randrange(32000)
                r.all_token_ids.append(t)
                r.block_hashes.extend(r.hasher.extend([t]))
            t0 = time.perf_counter()
            answers = [m.allocate_slots(r, 1) for r in reqs]
            t1 = time.perf_counter()
            m.flush()
            t2 = time.perf_counter()
            for a in answers:
                assert a is not None
                a.get_block_ids()
            t3 = time.perf_counter()
            for r in reqs:
                r.num_computed_tokens += 1
            build.append(t1 - t0)
            flush.append(t2 - t1)
            read.append(t3 - t2)
            _ = m.usage
        s = m.keeper
        noop = []
        for _ in range(100):
            t0 = time.perf_counter()
            client.step("decode", [], s.session_id, s.fence, include_state=True)
            noop.append(time.perf_counter() - t0)
        ms = 1e3
        print(f"{args.running} promised decode allocations per step, median of {args.steps} steps:")
        print(f"  build in the client {statistics.median(build) * ms:.2f} ms; flush {statistics.median(flush) * ms:.2f} ms; "
              f"reading the ids {statistics.median(read) * ms:.2f} ms; no-op Step {statistics.median(noop) * ms:.3f} ms; "
              f"runs sent as columns: {m.run_entries} entries")  # fmt: skip
        m.close()
        client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
