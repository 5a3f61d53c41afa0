"""vLLM 0.33's record_blocks_for_zeroing over real gRPC (RecordBlocksForZeroingOp): in a
pool with needs_kv_cache_zeroing, the blocks a failed asynchronous KV load left
unwritten are recorded again for the next TakeNewBlockIdsOp. The ids are the ones vLLM
0.33.0's own KVCacheManager answers for these calls (recorded in its venv; see
tests/unit/test_zeroing033.py, which makes the same calls on the engine)."""

from __future__ import annotations

import pytest
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import PoolBusyError
from kvcoord.client.vllm033 import NO_ADMISSION, Predicting033KVCacheManager, Remote033KVCacheManager
from kvcoord.v1 import allocator_pb2 as pb
from support import Req

INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9


def pool(profile: str = "vllm-0.33") -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=40,
        groups=[
            pb.KVCacheGroupSpec(
                full=pb.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float16")
            ),
            pb.KVCacheGroupSpec(
                sliding_window=pb.SlidingWindowSpec(
                    block_size=16, sliding_window=32, num_kv_heads=2, head_size=16, dtype="bfloat16"
                )
            ),
        ],
        hash_block_size=16,
        enable_caching=False,
        hash_algo="sha256_cbor",
        hash_seed="0",
        profile=profile,
        max_model_len=1024,
        max_in_flight_tokens=256,
        needs_kv_cache_zeroing=profile == "vllm-0.33",
    )


def record(rid: str, start: int) -> pb.Operation:
    return pb.Operation(
        record_blocks_for_zeroing=pb.RecordBlocksForZeroingOp(request_id=rid, start_token=start)
    )


TAKE = pb.Operation(take_new_block_ids=pb.TakeNewBlockIdsOp())


def test_a_failed_load_s_blocks_are_zeroed_again_over_grpc(client: KVCoordClient) -> None:
    client.create_pool("zero", pool())
    att = client.attach("zero", "sha256_cbor", 16, "0", profile="vllm-0.33")

    def step(*ops: pb.Operation, key: str = "") -> list[pb.OperationResult]:
        request = pb.StepRequest(
            pool="zero", session_id=att.session_id, ops=list(ops), idempotency_key=key, fence=att.fence
        )
        return list(client.send_step(request).results)

    # A's 48 tokens come from an asynchronous load (its groups' blocks not zeroed); B's not
    load = pb.AllocateOp(
        request=pb.RequestSync(request_id="A", append_token_ids=list(range(50)), new_request=True),
        num_new_tokens=0, num_external_computed_tokens=48, delay_cache_blocks=True,
        skip_zeroing_group_ids=[0, 1],
    )  # fmt: skip
    b = pb.AllocateOp(
        request=pb.RequestSync(request_id="B", append_token_ids=list(range(40)), new_request=True),
        num_new_tokens=40,
    )
    a, bb, taken = step(pb.Operation(allocate=load), pb.Operation(allocate=b), TAKE)
    assert a.status_code == 0 and bb.status_code == 0, (a.status_message, bb.status_message)
    assert list(taken.take_new_block_ids.block_ids) == [6, 7, 8, 9, 10, 11]
    # the load failed with 16 valid tokens: A's blocks from the second on, both groups
    (recorded,) = step(record("A", 16), key="zero-1")
    assert recorded.status_code == 0, recorded.status_message
    assert recorded.WhichOneof("result") == "record_blocks_for_zeroing"
    (again,) = step(record("A", 16), key="zero-1")  # a retried Step: answered, not applied twice
    assert again == recorded
    (taken,) = step(TAKE)
    assert list(taken.take_new_block_ids.block_ids) == [2, 3, 4, 5]
    # from the start: the window's null block (id 0) too, as vLLM
    _, taken = step(record("A", 0), TAKE)
    assert list(taken.take_new_block_ids.block_ids) == [1, 2, 3, 0, 4, 5]
    # refused, nothing recorded: a start inside a block, an unknown request; and no other
    # session can name A (the pool's blocks to zero are its one session's: POOL_EXCLUSIVE)
    with pytest.raises(PoolBusyError, match="to zero"):
        client.attach("zero", "sha256_cbor", 16, "0", profile="vllm-0.33")
    (misaligned,) = step(record("A", 20))
    (unknown,) = step(record("X", 0))
    (taken,) = step(TAKE)
    assert misaligned.status_code == INVALID_ARGUMENT, misaligned.status_message
    assert "not a multiple of group 0's block size 16" in misaligned.status_message
    assert unknown.reason == pb.REQUEST_UNKNOWN, unknown.status_message
    assert list(taken.take_new_block_ids.block_ids) == []


def test_recording_for_zeroing_is_a_033_call_over_grpc(client: KVCoordClient) -> None:
    client.create_pool("zero16", pool("vllm-0.16"))
    att = client.attach("zero16", "sha256_cbor", 16, "0")
    ops = [
        pb.Operation(
            allocate=pb.AllocateOp(
                request=pb.RequestSync(request_id="A", append_token_ids=list(range(40)), new_request=True),
                num_new_tokens=40,
            )
        ),
        record("A", 0),
    ]
    a, r = client.step("zero16", ops, att.session_id, att.fence).results
    assert a.status_code == 0, a.status_message
    assert r.status_code == FAILED_PRECONDITION, r.status_message
    assert "record_blocks_for_zeroing is a vllm-0.33 call" in r.status_message


@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
def test_the_plug_in_s_sessions_record_for_zeroing(client: KVCoordClient, predict: bool) -> None:
    """The 0.33 plug-in's sessions, waiting for the pool's answers (the op goes with the
    next call) and predicted (the mirror answers the next take at once; the Step checks
    the server's answer against it): the ids of the test above."""
    name = f"zero-{'p' if predict else 'w'}"
    client.create_pool(name, pool())
    cls = Predicting033KVCacheManager if predict else Remote033KVCacheManager
    m = cls(client, name, hash_seed="0", renew=False)
    m.admission = (False, 0, 0, 0, (0, 1))  # A's 48 tokens come from an asynchronous load
    a = m.allocate_slots(Req("A", list(range(50))), 0, 0, None, 0, 48, True)
    assert a is not None and a.block_ids == ([], [])
    m.admission = NO_ADMISSION
    b = m.allocate_slots(Req("B", list(range(40))), 40)
    assert b is not None and b.block_ids == ([6, 7, 8], [9, 10, 11])
    assert m.take_new_block_ids() == [6, 7, 8, 9, 10, 11]
    m.record_blocks_for_zeroing("A", 16)
    assert m.take_new_block_ids() == [2, 3, 4, 5]
    m.record_blocks_for_zeroing("A", 0)
    assert m.take_new_block_ids() == [1, 2, 3, 0, 4, 5]
    m.flush()
    assert list(client.check_pool(name).violations) == []
    m.close()
