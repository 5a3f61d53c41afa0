"""CheckPool over real gRPC on a vllm-0.33 pool of full attention and a mamba group
outside "align" mode (vLLM 0.33 runs it with prefix caching off; the pool's hash block
is the mamba block, larger than the attention block) while a request is live: the
check answers (no violation) instead of gRPC INTERNAL (a ZeroDivisionError in the
engine's invariants, found by a review running vLLM 0.33's scheduler on such a pool)."""

from __future__ import annotations

from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb

MAMBA_BLOCK = 1024


def test_a_mamba_pool_without_caching_is_checked_with_a_live_request(client: KVCoordClient) -> None:
    client.create_pool(
        "m",
        pb.PoolConfig(
            num_blocks=40,
            groups=[
                pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=16)),
                pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=MAMBA_BLOCK, mamba_cache_mode="none")),
            ],
            hash_block_size=MAMBA_BLOCK,
            enable_caching=False,
            hash_algo="sha256_cbor",
            hash_seed="0",
            profile="vllm-0.33",
            max_model_len=4096,
        ),  # fmt: skip
    )
    sid, fence = attach(client, "m", MAMBA_BLOCK, profile="vllm-0.33")
    got = client.allocate("m", allocate("a", list(range(100)), 100, MAMBA_BLOCK).allocate, sid, fence)
    assert not got.result.refused
    check = client.check_pool("m")
    assert list(check.violations) == [] and check.num_requests_checked == 1
