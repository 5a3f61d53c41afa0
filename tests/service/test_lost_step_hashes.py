"""A waiting session's Step whose outcome is unknown (its answer lost past every
retry) over real gRPC: the requests it touched are reported lost and freed on the
server (best effort). Its allocation, which the server may have applied, cached the
hashes of the blocks the step was to compute; the step never ran (the scheduler
recomputes lost requests), so their KV was never written. The free drops those cache
entries (``FreeOp.uncomputed_from``, the computed count the lost Step carried): no
later lookup, of this worker or another sharing the pool, hits them."""

from __future__ import annotations

from typing import Any

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


class _DropThenCut(FaultInjector):
    """Answers of the first ``drops`` Step and Free calls are lost (each applied), then
    the network is cut (nothing more reaches the server) until healed."""

    def __init__(self, drops: int) -> None:
        super().__init__(0, drop=1.0, methods=("Step", "Free"))
        self.left = drops

    def _next(self) -> None:
        if self.enabled:
            if self.left:
                self.left -= 1
            else:
                self.partitioned = True

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if details.method.rsplit("/", 1)[-1] in self.methods:
            self._next()
        return super().intercept_unary_unary(continuation, details, request)

    def draw_message(self, request: Any) -> tuple[str, Any]:  # (a Step on the StepStream)
        self._next()
        return super().draw_message(request)


@pytest.mark.parametrize("free_applied", [False, True])
def test_a_lost_requests_free_whose_own_outcome_is_unknown_is_sent_again(
    server: InProcessServer, free_applied: bool
) -> None:
    """The free of a lost Step's request fails too, its outcome unknown (the first of
    its attempts applied or not, the rest cut off). The free is sent again, first in the
    next Step (``if_held``: a free that was applied is not an error then): the request
    is freed and its never-computed blocks are no hit. (A guard: ``OutcomeUnknownError``
    is one of the sender's transient errors, an ``UnavailableError``. Were the free
    dropped, the request would stay held until its session ended, its 24
    never-computed tokens' blocks cached for every lookup: 40 hits instead of 16.)"""
    computed = 16
    faults = _DropThenCut(drops=3 if free_applied else 2)
    faults.enabled = False
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)
    with KVCoordClient(server.address, timeout=10, retry=policy, interceptors=[faults]) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        req = Req("a", list(PROMPT))
        assert m.allocate_slots(req, computed) is not None
        req.num_computed_tokens = computed
        faults.enabled = True
        with pytest.raises(RequestsLostError) as lost:
            m.allocate_slots(req, len(PROMPT) - computed)
        assert lost.value.request_ids == ["a"]
        assert faults.partitioned and faults.counts["dropped"] == (3 if free_applied else 2)
        faults.enabled = faults.partitioned = False
        assert c.get_stats("p").num_requests == (0 if free_applied else 1)  # (not yet sent again)
        other = Req("b", [7000 + i for i in range(8)])
        assert m.allocate_slots(other, 8) is not None  # its Step carries the free first
        assert _hit(c, PROMPT) == computed
        assert c.get_stats("p").num_requests == 1  # "b" only
        m.free(other)
        m.close()
