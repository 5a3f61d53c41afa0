"""Pools that keep state of their scheduler's steps as the pool's own admit one session
at a time (real gRPC).

A vllm-0.33 pool with a mamba group, or one whose worker zeroes new blocks
(``needs_kv_cache_zeroing``), keeps the ids of new blocks to zero, the mamba groups'
boundary-state hand-offs and the set of state blocks cached during the current step
(not hittable until the next): all the pool's, not a request's. A second session,
of any tenant, would take the first one's blocks to zero (its worker then reads
whatever the blocks held before), learn its request ids from the hand-offs, or start
a step in the middle of the first's and make a state block nobody has written yet a
hit. So the second Attach is refused (POOL_EXCLUSIVE, with the reason), as it was for
fine-grained hits already."""

from __future__ import annotations

import hashlib

import pytest
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import PoolBusyError
from kvcoord.v1 import allocator_pb2 as pb

BS = 32


def _zeroing_pool() -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=40,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=16))],
        hash_block_size=16, enable_caching=False, hash_algo="sha256_cbor", hash_seed="0",
        profile="vllm-0.33", max_model_len=1024, needs_kv_cache_zeroing=True,
    )  # fmt: skip


def _mamba_pool() -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=24,
        groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS)),
            pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=BS, mamba_cache_mode="align")),
        ],
        hash_block_size=BS, enable_caching=True, hash_algo="sha256_cbor", hash_seed="0",
        profile="vllm-0.33", max_model_len=1024,
    )  # fmt: skip


def _registration(rid: str, tokens: list[int]) -> pb.RequestSync:
    hashes = [
        hashlib.sha256(repr(tokens[: (i + 1) * BS]).encode()).digest() for i in range(len(tokens) // BS)
    ]
    return pb.RequestSync(
        request_id=rid, append_token_ids=tokens, append_block_hashes=hashes, new_request=True
    )


@pytest.mark.parametrize(
    ("make", "block_size", "reason", "take"),
    [
        (_zeroing_pool, 16, "new blocks' ids", pb.Operation(take_new_block_ids=pb.TakeNewBlockIdsOp())),
        (
            _mamba_pool, BS, "mamba groups",
            pb.Operation(take_boundary_state_offloads=pb.TakeBoundaryStateOffloadsOp()),
        ),
    ],
    ids=["zeroing", "mamba"],
)  # fmt: skip
def test_a_pool_keeping_its_schedulers_step_state_admits_one_session(
    client: KVCoordClient, make: object, block_size: int, reason: str, take: pb.Operation
) -> None:
    name = make.__name__.strip("_")  # type: ignore[attr-defined]
    client.create_pool(name, make())  # type: ignore[operator]
    first = client.attach(name, "sha256_cbor", block_size, "0", profile="vllm-0.33")
    alloc = pb.AllocateOp(request=_registration("r", list(range(120))), num_new_tokens=96)
    (r,) = client.step(name, [pb.Operation(allocate=alloc)], first.session_id, first.fence).results
    assert r.status_code == 0, r.status_message
    with pytest.raises(PoolBusyError, match=reason) as refused:
        client.attach(name, "sha256_cbor", block_size, "0", profile="vllm-0.33")
    assert refused.value.reason == "POOL_EXCLUSIVE"
    # what the pool keeps for its one scheduler is still there for it to take
    (mine,) = client.step(name, [take], first.session_id, first.fence).results
    assert mine.status_code == 0, mine.status_message
    if take.HasField("take_new_block_ids"):
        assert list(mine.take_new_block_ids.block_ids) == list(r.allocate.new_block_ids[0].block_ids)
    else:
        assert [o.request_id for o in mine.take_boundary_state_offloads.offloads] == ["r"]
    client.detach(first.session_id, first.fence)
    client.attach(name, "sha256_cbor", block_size, "0", profile="vllm-0.33")  # once it ended


def test_a_vllm_016_pool_and_a_plain_033_pool_admit_many_sessions(client: KVCoordClient) -> None:
    """Nothing changes for pools without such state."""
    plain = _zeroing_pool()
    plain.needs_kv_cache_zeroing = False
    client.create_pool("plain033", plain)
    client.attach("plain033", "sha256_cbor", 16, "0", profile="vllm-0.33")
    client.attach("plain033", "sha256_cbor", 16, "0", profile="vllm-0.33")
    old = _zeroing_pool()
    old.needs_kv_cache_zeroing, old.profile = False, ""
    client.create_pool("plain016", old)
    client.attach("plain016", "sha256_cbor", 16, "0")
    client.attach("plain016", "sha256_cbor", 16, "0")
