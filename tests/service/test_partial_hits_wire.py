"""vLLM 0.33's fine-grained (partial) hits over real gRPC: the copy-on-write pairs a Step
drains (TakeKVCacheBlockCopiesOp) and their ordered release (ReleaseRetainedBlocksOp),
refused with BLOCK_NOT_RETAINED for a block not retained. The ids are those vLLM
0.33.0's own KVCacheManager printed for the same calls (see
tests/unit/test_partial_hits_033.py)."""

from __future__ import annotations

import hashlib

from kvcoord.client import KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb

HBS = 16
P = list(range(1, 57))
FAILED_PRECONDITION = 9


def pool() -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=24,
        groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=32)),
            pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=32, mamba_cache_mode="align")),
        ],
        hash_block_size=HBS,
        enable_caching=True,
        hash_algo="sha256_cbor",
        hash_seed="0",
        profile="vllm-0.33",
        max_model_len=1024,
    )


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
