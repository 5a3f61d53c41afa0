"""vLLM 0.33's deferred free beside a mamba group over real gRPC: the request's pending
boundary-state hand-offs dropped when vLLM takes its blocks (DropBoundaryStateOffloadsOp),
its blocks freed a step later in one reversed pass (FreeOp.all_groups_reversed), which a
pool with a mamba group refused before. The hand-off (group 1, block 4, 96 tokens) is
the one vLLM 0.33.0's own KVCacheManager records for these calls
(tests/with_vllm/test_mamba033_engine.py drives both alike)."""

from __future__ import annotations

import hashlib

from kvcoord.client import KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb

BS = 32
FAILED_PRECONDITION = 9


def pool(profile: str = "vllm-0.33") -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=24,
        groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS)),
            pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=BS, mamba_cache_mode="align")),
        ],
        hash_block_size=BS,
        enable_caching=True,
        hash_algo="sha256_cbor",
        hash_seed="0",
        profile=profile,
        max_model_len=1024,
    )


def new(rid: str, tokens: list[int]) -> pb.RequestSync:
    hashes = [
        hashlib.sha256(repr(tokens[: (i + 1) * BS]).encode()).digest() for i in range(len(tokens) // BS)
    ]
    return pb.RequestSync(
        request_id=rid, append_token_ids=tokens, append_block_hashes=hashes, new_request=True
    )


def drop(rid: str) -> pb.Operation:
    return pb.Operation(drop_boundary_state_offloads=pb.DropBoundaryStateOffloadsOp(request_id=rid))


def test_a_deferred_free_beside_mamba_drops_hand_offs_at_the_take_over_grpc(client: KVCoordClient) -> None:
    client.create_pool("defer", pool())
    att = client.attach("defer", "sha256_cbor", BS, "0", profile="vllm-0.33")

    free: list[int] = []

    def step(*ops: pb.Operation) -> list[pb.OperationResult]:
        response = client.step("defer", list(ops), att.session_id, att.fence)
        free.append(response.num_free_blocks)
        return list(response.results)

    # A and B each end a chunk on their prompt's boundary (96 of 120): a hand-off each
    a, b = step(
        pb.Operation(allocate=pb.AllocateOp(request=new("A", list(range(120))), num_new_tokens=96)),
        pb.Operation(allocate=pb.AllocateOp(request=new("B", list(range(500, 620))), num_new_tokens=96)),
    )
    assert a.status_code == 0 and b.status_code == 0, (a.status_message, b.status_message)
    # vLLM takes A's blocks (its free deferred) before the drain: A's hand-off is gone
    dropped, taken = step(
        drop("A"), pb.Operation(take_boundary_state_offloads=pb.TakeBoundaryStateOffloadsOp())
    )
    assert dropped.status_code == 0, dropped.status_message
    assert dropped.WhichOneof("result") == "drop_boundary_state_offloads"
    offloads = {(o.request_id, o.group_id, o.block_id, o.boundary_tokens) for o in
                taken.take_boundary_state_offloads.offloads}  # fmt: skip
    assert offloads == {("B", 1, 8, 96)}, offloads
    # a step later the blocks return, all groups in one reversed pass
    (freed,) = step(pb.Operation(free=pb.FreeOp(request_id="A", all_groups_reversed=True)))
    assert freed.status_code == 0, freed.status_message
    (freed,) = step(pb.Operation(free=pb.FreeOp(request_id="B", all_groups_reversed=True)))
    assert freed.status_code == 0, freed.status_message
    assert list(client.check_pool("defer").violations) == []  # references = holders
    # 4 blocks each (3 full attention, 1 mamba state), held until the free, then back
    assert free == [15, 15, 19, 23], free


def test_dropping_hand_offs_is_a_033_call_over_grpc(client: KVCoordClient) -> None:
    client.create_pool("defer16", pool("vllm-0.16"))
    att = client.attach("defer16", "sha256_cbor", BS, "0")
    ops = [
        pb.Operation(allocate=pb.AllocateOp(request=new("A", list(range(120))), num_new_tokens=96)),
        drop("A"),
    ]
    a, d = client.step("defer16", ops, att.session_id, att.fence).results
    assert a.status_code == 0, a.status_message
    assert d.status_code == FAILED_PRECONDITION, d.status_message
