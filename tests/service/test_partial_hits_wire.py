"""vLLM 0.33's fine-grained (partial) hits over real gRPC: the copy-on-write pairs a Step
drains (TakeKVCacheBlockCopiesOp) and their ordered release (ReleaseRetainedBlocksOp),
refused with BLOCK_NOT_RETAINED for a block not retained. The ids are those vLLM
0.33.0's own KVCacheManager printed for the same calls (see
tests/unit/test_partial_hits_033.py)."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import (
    KVCoordError,
    OutcomeUnknownError,
    PoolBusyError,
    RequestsLostError,
    UnavailableError,
)
from kvcoord.client.vllm033 import Remote033KVCacheManager
from kvcoord.v1 import allocator_pb2 as pb
from support import wire_mamba_pool_033

HBS = 16
P = list(range(1, 57))
FAILED_PRECONDITION = 9


def pool() -> pb.PoolConfig:
    return wire_mamba_pool_033(24, 32, 32, "align", HBS, 1024)


def hashes(tokens: list[int]) -> list[bytes]:
    return [
        hashlib.sha256(repr(tokens[: (i + 1) * HBS]).encode()).digest() for i in range(len(tokens) // HBS)
    ]


def test_copies_are_drained_and_released_in_order_over_grpc(client: KVCoordClient) -> None:
    client.create_pool("cow", pool())
    att = client.attach("cow", "sha256_cbor", HBS, "0", profile="vllm-0.33")

    def step(*ops: pb.Operation) -> list[pb.OperationResult]:
        return list(client.step("cow", list(ops), att.session_id, att.fence).results)

    first = pb.RequestSync(
        request_id="A", append_token_ids=P, append_block_hashes=hashes(P), new_request=True
    )
    (r,) = step(pb.Operation(allocate=pb.AllocateOp(request=first, num_new_tokens=48)))
    assert r.status_code == 0, r.status_message
    assert [list(g.block_ids) for g in r.allocate.new_block_ids] == [[1, 2], [0, 3]]
    # A's next chunk: its mamba tail at 48 moves to block 4, copied from 3
    more = pb.RequestSync(request_id="A", base_num_tokens=56, base_num_hashes=3, num_computed_tokens=48)
    a, c = step(
        pb.Operation(allocate=pb.AllocateOp(request=more, num_new_tokens=8)),
        pb.Operation(take_kv_cache_block_copies=pb.TakeKVCacheBlockCopiesOp()),
    )
    assert a.status_code == 0 and c.status_code == 0, (a.status_message, c.status_message)
    assert [(x.src_block_id, x.dst_block_id) for x in c.take_kv_cache_block_copies.copies] == [(3, 4)]
    assert list(c.take_kv_cache_block_copies.retained_block_ids) == [3, 4]
    # a block not retained (or twice): refused by reason, nothing released
    (bad,) = step(pb.Operation(release_retained_blocks=pb.ReleaseRetainedBlocksOp(block_ids=[4, 4])))
    assert bad.status_code == FAILED_PRECONDITION
    assert bad.reason == pb.BLOCK_NOT_RETAINED
    (ok,) = step(pb.Operation(release_retained_blocks=pb.ReleaseRetainedBlocksOp(block_ids=[3, 4])))
    assert ok.status_code == 0, ok.status_message
    assert ok.WhichOneof("result") == "release_retained_blocks"
    (again,) = step(pb.Operation(release_retained_blocks=pb.ReleaseRetainedBlocksOp(block_ids=[3])))
    assert again.reason == pb.BLOCK_NOT_RETAINED
    assert list(client.check_pool("cow").violations) == []  # references = holders


def _take_a_pair(client: KVCoordClient, session_id: str, fence: pb.Fence, free: bool = False) -> list[int]:
    """Request A makes a copy-on-write pair, taken on the session (and A freed, when
    ``free``: the pair's ids are then held by the retention only); its retained ids."""
    first = pb.RequestSync(
        request_id="A", append_token_ids=P, append_block_hashes=hashes(P), new_request=True
    )
    more = pb.RequestSync(request_id="A", base_num_tokens=56, base_num_hashes=3, num_computed_tokens=48)
    ops = [
        pb.Operation(allocate=pb.AllocateOp(request=first, num_new_tokens=48)),
        pb.Operation(new_step_starts=pb.NewStepStartsOp()),
        pb.Operation(allocate=pb.AllocateOp(request=more, num_new_tokens=8)),
        pb.Operation(take_kv_cache_block_copies=pb.TakeKVCacheBlockCopiesOp()),
        *([pb.Operation(free=pb.FreeOp(request_id="A"))] if free else []),
    ]
    results = client.step("cow", ops, session_id, fence).results
    assert [r.status_code for r in results] == [0] * len(ops), [r.status_message for r in results]
    retained = list(results[3].take_kv_cache_block_copies.retained_block_ids)
    assert len(retained) == 2  # one pair
    return retained


def _copy_then_lose(client: KVCoordClient, lease_seconds: float = 30.0) -> tuple[str, pb.Fence]:
    """A session that takes a pair and never releases it."""
    att = client.attach("cow", "sha256_cbor", HBS, "0", profile="vllm-0.33", lease_seconds=lease_seconds)
    _take_a_pair(client, att.session_id, att.fence)
    return att.session_id, att.fence


def test_a_session_end_releases_its_retained_blocks_over_grpc(
    server: object, client: KVCoordClient, clock: object
) -> None:
    """Detach, then lease expiry: the pairs the lost session took (never released) die
    with it, so every block is free again and the prefix cache can be reset."""
    client.create_pool("cow", pool())
    free0 = client.get_stats("cow").num_free_blocks
    sid, fence = _copy_then_lose(client)
    client.detach(sid, fence)
    assert client.get_stats("cow").num_free_blocks == free0
    assert list(client.check_pool("cow").violations) == []
    assert client.reset_prefix_cache("cow").result
    sid, fence = _copy_then_lose(client, lease_seconds=5)
    clock.advance(6)  # type: ignore[attr-defined]
    assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[attr-defined]
    assert client.get_stats("cow").num_free_blocks == free0
    assert list(client.check_pool("cow").violations) == []
    assert client.reset_prefix_cache("cow").result


def test_a_pool_with_partial_hits_admits_one_session_at_a_time(client: KVCoordClient) -> None:
    """The copy-on-write pairs are the pool's: a second session would drain the first's
    pairs (its worker would never run them) or release its blocks. Refused by reason."""
    client.create_pool("cow", pool())
    att = client.attach("cow", "sha256_cbor", HBS, "0", profile="vllm-0.33")
    with pytest.raises(PoolBusyError, match="fine-grained") as err:
        client.attach("cow", "sha256_cbor", HBS, "0", profile="vllm-0.33")
    assert err.value.reason == "POOL_EXCLUSIVE"
    client.detach(att.session_id, att.fence)
    client.attach("cow", "sha256_cbor", HBS, "0", profile="vllm-0.33")  # once it ended


def _waiting_manager_with_a_pair(client: KVCoordClient) -> tuple[Remote033KVCacheManager, list[int]]:
    """The plug-in's waiting-mode manager; a pair made and taken on its session, its
    request freed."""
    client.create_pool("cow", pool())
    m = Remote033KVCacheManager(client, "cow", hash_seed="0", renew=False)
    return m, _take_a_pair(client, m.session_id, m.keeper.fence, free=True)


def _fail_next_step(m: Remote033KVCacheManager, err: KVCoordError) -> None:
    real = m.sender._send

    def failing(*args: object, **kwargs: object) -> pb.StepResponse:
        m.sender._send = real  # type: ignore[method-assign]
        raise err

    m.sender._send = failing  # type: ignore[method-assign]


def test_a_release_in_a_step_that_was_not_applied_is_sent_again(client: KVCoordClient) -> None:
    """Waiting mode: the Step carrying the scheduler's release failed as a whole and was
    not applied (UNAVAILABLE): the release goes with the next Step, as a free would."""
    m, ids = _waiting_manager_with_a_pair(client)
    m.release_retained_blocks(ids)  # queued for the next Step
    _fail_next_step(m, UnavailableError(grpc.StatusCode.UNAVAILABLE, "injected"))
    with pytest.raises(UnavailableError):
        m.flush()
    m.flush()
    assert client.reset_prefix_cache("cow").result  # nothing retained any more
    assert list(client.check_pool("cow").violations) == []
    m.close()


def test_a_release_whose_outcome_is_unknown_ends_the_session(client: KVCoordClient) -> None:
    """Waiting mode: whether the release applied is unknown: sent again it could release
    a pair made since, so the session ends (requests lost, retentions released with it)."""
    m, ids = _waiting_manager_with_a_pair(client)
    free0 = client.get_stats("cow").num_free_blocks
    old = m.session_id
    m.release_retained_blocks(ids)
    _fail_next_step(m, OutcomeUnknownError(grpc.StatusCode.UNAVAILABLE, "injected"))
    with pytest.raises(RequestsLostError):
        m.flush()
    assert m.session_id != old  # a new session
    assert client.get_stats("cow").num_free_blocks == free0 + len(ids)
    assert client.reset_prefix_cache("cow").result
    m.close()
