"""Semantics profiles over real gRPC: a pool carries its profile, and the handshake
refuses a worker that follows another one (PROFILE_MISMATCH)."""

from __future__ import annotations

import pytest
from kvcoord.client import HashMismatchError, InvalidArgumentError, KVCoordClient, ProfileMismatchError
from kvcoord.client.errors import FailedPreconditionError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb


def pool(profile: str = "") -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=32,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
        hash_block_size=4,
        enable_caching=True,
        hash_algo="sha256_cbor",
        hash_seed="0",
        profile=profile,
    )


def test_pool_carries_its_profile(client: KVCoordClient) -> None:
    """CreatePool takes the profile; GetPool and ListPools report it."""
    client.create_pool("new", pool("vllm-0.33"))
    assert client.get_pool("new").pool.config.profile == "vllm-0.33"
    listed = {p.name: p.config.profile for p in client.list_pools().pools}
    assert listed["new"] == "vllm-0.33"
    client.create_pool("old", pool())
    assert client.get_pool("old").pool.config.profile == ""  # empty: vllm-0.16


def test_unknown_profile_is_invalid(client: KVCoordClient) -> None:
    with pytest.raises(InvalidArgumentError, match="profile must be one of vllm-0.16, vllm-0.33"):
        client.create_pool("bad", pool("vllm-0.20"))


def test_033_refuses_layouts_it_does_not_reproduce(client: KVCoordClient) -> None:
    """A mamba layout the vllm-0.33 profile does not model (a mamba block larger than
    the hash block: vLLM 0.33's sub-block hits with copy-on-write) is refused at
    creation with the reason, not answered with other rules; the modelled one (align,
    mamba block = hash block) is created."""
    cfg = pool("vllm-0.33")
    cfg.groups.append(pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=8, mamba_cache_mode="align")))
    with pytest.raises(
        InvalidArgumentError, match="vllm-0.33 profile does not support yet: group 1: mamba.*copy-on-write"
    ):
        client.create_pool("hybrid", cfg)
    cfg.groups[1].mamba.block_size = 4
    client.create_pool("hybrid", cfg)


@pytest.mark.parametrize(("pool_profile", "client_profile"), [("vllm-0.33", ""), ("", "vllm-0.33"),
                                                              ("vllm-0.33", "vllm-0.16")])  # fmt: skip
def test_attach_with_another_profile_is_refused(
    client: KVCoordClient, pool_profile: str, client_profile: str
) -> None:
    """Same hash settings, other profile: FAILED_PRECONDITION, reason PROFILE_MISMATCH,
    raised as a HashMismatchError subclass; no session is made."""
    client.create_pool("x", pool(pool_profile))
    with pytest.raises(ProfileMismatchError, match="follows profile") as err:
        client.attach("x", "sha256_cbor", 4, "0", profile=client_profile)
    assert isinstance(err.value, HashMismatchError) and isinstance(err.value, FailedPreconditionError)
    assert err.value.reason == "PROFILE_MISMATCH"
    assert client.get_pool("x").pool.num_requests == 0
    att = client.attach("x", "sha256_cbor", 4, "0", profile=pool_profile or "vllm-0.16")
    assert att.session_id


def test_033_calls_on_a_016_pool_are_refused(client: KVCoordClient) -> None:
    """full_sequence_must_fit and record_prefix_cache_stats exist only in vllm-0.33."""
    client.create_pool("old", pool())
    att = client.attach("old", "sha256_cbor", 4, "0")
    sync = pb.RequestSync(request_id="r", append_token_ids=[1, 2, 3], new_request=True)
    op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=3, full_sequence_must_fit=True))
    res = client.step("old", [op], att.session_id, att.fence).results[0]
    assert res.status_code == 3 and "vLLM 0.33 inputs" in res.status_message  # INVALID_ARGUMENT
    sync = pb.RequestSync(request_id="r", append_token_ids=[1, 2, 3], new_request=True)
    ops = [
        pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=3)),
        pb.Operation(record_prefix_cache_stats=pb.RecordPrefixCacheStatsOp(request_id="r", num_hits=0)),
    ]
    res = client.step("old", ops, att.session_id, att.fence).results[1]
    assert res.status_code == 9 and "records statistics at each lookup" in res.status_message


def test_watermark_travels_with_the_allocation(client: KVCoordClient) -> None:
    """AllocateOp.watermark_blocks reaches the vllm-0.33 engine's admission check: the
    allocation must leave that many blocks free (31 usable, one block taken)."""
    client.create_pool("new", pool("vllm-0.33"))
    att = client.attach("new", "sha256_cbor", 4, "0", profile="vllm-0.33")
    results = []
    for rid, watermark in (("a", 31), ("b", 30)):
        sync = pb.RequestSync(request_id=rid, append_token_ids=[1, 2, 3], new_request=True)
        a = pb.AllocateOp(request=sync, num_new_tokens=3, watermark_blocks=watermark)
        results.append(client.step("new", [pb.Operation(allocate=a)], att.session_id, att.fence).results[0])
    assert results[0].status_code == 0 and results[0].allocate.refused
    assert (
        results[1].status_code == 0
        and not results[1].allocate.refused
        and list(results[1].allocate.new_block_ids[0].block_ids) == [1]
    )
    client.create_pool("old", pool())
    old = client.attach("old", "sha256_cbor", 4, "0")
    sync = pb.RequestSync(request_id="r", append_token_ids=[1, 2, 3], new_request=True)
    op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=3, watermark_blocks=1))
    res = client.step("old", [op], old.session_id, old.fence).results[0]
    assert res.status_code == 3 and "vLLM 0.33 inputs" in res.status_message  # INVALID_ARGUMENT


def test_config_file_pool_profile(make_server: object) -> None:
    """A [[pools]] table takes `profile`."""
    text = """
[[pools]]
name = "p33"
profile = "vllm-0.33"
num_blocks = 16
hash_block_size = 4
enable_caching = true
hash_algo = "sha256_cbor"
hash_seed = "0"
[[pools.groups]]
type = "full"
block_size = 4
"""
    srv = InProcessServer(text)
    srv.start()
    try:
        with KVCoordClient(srv.address) as c:
            assert c.get_pool("p33").pool.config.profile == "vllm-0.33"
    finally:
        srv.stop()


def test_attach_with_another_lookahead_is_refused(client: KVCoordClient) -> None:
    """num_hash_lookahead_tokens is part of the hash handshake."""
    cfg = pool("vllm-0.33")
    cfg.num_hash_lookahead_tokens = 1
    client.create_pool("eagle", cfg)
    with pytest.raises(HashMismatchError, match="num_hash_lookahead_tokens is 1 but the client uses 0"):
        client.attach("eagle", "sha256_cbor", 4, "0", profile="vllm-0.33")
    assert client.attach(
        "eagle", "sha256_cbor", 4, "0", profile="vllm-0.33", num_hash_lookahead_tokens=1
    ).session_id


def test_the_mamba_drains_are_033_calls(client: KVCoordClient) -> None:
    """TakeNewBlockIdsOp, TakeBoundaryStateOffloadsOp and TakeKVCacheBlockCopiesOp are
    vLLM 0.33's calls: a vllm-0.16 pool refuses each with FAILED_PRECONDITION naming it
    (vLLM 0.16 has none of them); a vllm-0.33 pool answers them (empty here: nothing
    was allocated)."""
    ops = {
        "take_new_block_ids": pb.TakeNewBlockIdsOp(),
        "take_boundary_state_offloads": pb.TakeBoundaryStateOffloadsOp(),
        "take_kv_cache_block_copies": pb.TakeKVCacheBlockCopiesOp(),
    }
    for profile in ("", "vllm-0.33"):
        name = f"drains{profile}"
        client.create_pool(name, pool(profile))
        att = client.attach(name, "sha256_cbor", 4, "0", profile=profile)
        for kind, message in ops.items():
            resp = client.step(name, [pb.Operation(**{kind: message})], att.session_id, att.fence)
            result = resp.results[0]
            if profile:
                assert result.status_code == 0, result.status_message
                assert result.WhichOneof("result") == kind
            else:
                assert result.status_code == 9, kind  # FAILED_PRECONDITION
                assert f"{kind} is a vllm-0.33 call" in result.status_message
