"""Memory per block and per live token, for the sizing guide in deploy/README.md.

    python bench/memory.py

Not a test. Builds a 1,000,000-block pool (its blocks are created on first use, so an
empty pool costs almost nothing), the same pool with every block created (RSS per block
once used: the steady state of a busy pool), then admits 500 requests of 2,000 random
tokens each with their sha256_cbor block hashes (RSS per token held).
"""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from kvcoord.client.hashing import BlockHasher, none_hash  # noqa: E402
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    n_blocks, n_reqs, n_tokens, bs = 1_000_000, 500, 2_000, 16
    cfg = KVCacheConfig(num_blocks=n_blocks, groups=(FullAttentionSpec(bs),), hash_block_size=bs)
    gc.collect()
    rl = rss()
    lazy = KVCachePool(cfg)
    gc.collect()
    print(f"empty pool, blocks created on first use: {(rss() - rl) / 2**10:.0f} KiB")
    del lazy
    gc.collect()
    r0 = rss()
    pool = KVCachePool(cfg, materialize_blocks=True)
    gc.collect()
    r1 = rss()
    none = none_hash("sha256_cbor", "0")
    rnd = random.Random(0)
    for i in range(n_reqs):
        tokens = [rnd.randrange(32000) for _ in range(n_tokens)]
        pool.add_request(f"r{i}", tokens, BlockHasher("sha256_cbor", bs, none).extend(tokens))
        assert pool.allocate_slots(f"r{i}", n_tokens) is not None
    gc.collect()
    r2 = rss()
    live = n_reqs * n_tokens
    print(
        f"every block created: {(r1 - r0) / n_blocks:.0f} bytes per block ({n_blocks} blocks, "
        f"{(r1 - r0) / 2**20:.0f} MiB)"
    )
    print(f"live requests: {(r2 - r1) / live:.0f} bytes per token held ({n_reqs} requests x {n_tokens} tokens, "
          f"{(r2 - r1) / 2**20:.0f} MiB, {live // bs} cached blocks)")  # fmt: skip


if __name__ == "__main__":
    main()
