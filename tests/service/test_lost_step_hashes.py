"""A waiting session's Step whose outcome is unknown (its answer lost past every
retry) over real gRPC: the requests it touched are reported lost and freed on the
server (best effort). Its allocation, which the server may have applied, cached the
hashes of the blocks the step was to compute; the step never ran (the scheduler
recomputes lost requests), so their KV was never written. The free drops those cache
entries (``FreeOp.uncomputed_from``, the computed count the lost Step carried): no
later lookup, of this worker or another sharing the pool, hits them."""

from __future__ import annotations

import pytest
from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.errors import RequestsLostError
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.retry import RetryPolicy
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import Req

PROMPT = [4000 + i for i in range(41)]  # 10 full blocks of 4


def _hit(c: KVCoordClient, tokens: list[int]) -> int:
    """The tokens of ``tokens`` a new request would hit (read only)."""
    hashes = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(tokens)
    prompt = pb.HashedPrompt(hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes)
    return c.score_pools(len(tokens), [prompt]).scores[0].hit_tokens


@pytest.mark.parametrize("computed", [0, 16])
def test_a_lost_steps_requests_are_freed_without_the_hashes_it_cached(
    server: InProcessServer, computed: int
) -> None:
    """Request "a" computed ``computed`` tokens in earlier steps (cached then, its KV
    written); the Step allocating the rest of its prompt is applied, its answer lost:
    after the loss only those ``computed`` tokens stay hits (the old code kept all 40)."""
    lose = FaultInjector(0, drop=1.0, methods=("Step", "StepStream"))
    lose.enabled = False
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)
    with KVCoordClient(server.address, timeout=10, retry=policy, interceptors=[lose]) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        req = Req("a", list(PROMPT))
        if computed:
            assert m.allocate_slots(req, computed) is not None  # the earlier steps
            req.num_computed_tokens = computed
        assert _hit(c, PROMPT) == computed
        lose.enabled = True
        with pytest.raises(RequestsLostError) as lost:
            m.allocate_slots(req, len(PROMPT) - computed)
        lose.enabled = False
        assert lost.value.request_ids == ["a"]
        assert lose.counts["dropped"] >= 1
        assert _hit(c, PROMPT) == computed
        assert c.get_stats("p").num_requests == 0
        m.close()
