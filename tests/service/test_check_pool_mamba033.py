"""CheckPool over real gRPC on a vllm-0.33 pool of full attention and a mamba group
outside "align" mode (vLLM 0.33 runs it with prefix caching off; the pool's hash block
is the mamba block, larger than the attention block) while a request is live: the
check answers (no violation) instead of gRPC INTERNAL (a ZeroDivisionError in the
engine's invariants, found by a review running vLLM 0.33's scheduler on such a pool)."""

from __future__ import annotations

from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from support import wire_mamba_pool_033

MAMBA_BLOCK = 1024


def test_a_mamba_pool_without_caching_is_checked_with_a_live_request(client: KVCoordClient) -> None:
    client.create_pool("m", wire_mamba_pool_033(40, 16, MAMBA_BLOCK, "none", MAMBA_BLOCK, 4096))
    sid, fence = attach(client, "m", MAMBA_BLOCK, profile="vllm-0.33")
    got = client.allocate("m", allocate("a", list(range(100)), 100, MAMBA_BLOCK).allocate, sid, fence)
    assert not got.result.refused
    check = client.check_pool("m")
    assert list(check.violations) == [] and check.num_requests_checked == 1
