"""A first allocation with external (KV connector) tokens beside a mamba ``align`` group,
one block short of what it takes (vLLM's count leaves out the external tokens' state
block; tests/unit/test_mamba_external.py), over real gRPC: the Allocate RPC and the Step
operation answer FAILED_PRECONDITION, reason UNCOUNTED_BLOCKS, with the pool unchanged
and clean; the same allocation succeeds once a block more is free, and its free returns
every block. A predicted session's mirror runs the same engine: it raises the same typed
error at the call and sends nothing (the server never sees the refused allocation, so
nothing it would refuse is sent and the session loses no request).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import FailedPreconditionError, KVCoordClient, PredictingKVCacheManager
from kvcoord.client.answers import op_error
from kvcoord.client.errors import KVCoordError
from kvcoord.client.mirror import Mirror
from kvcoord.v1 import allocator_pb2 as pb
from support import hashed_req

#: 13 tokens: 1 loaded by a connector, 12 to compute (full attention 4 blocks, mamba 2)
PROMPT = list(range(13))


def mamba_pool(num_blocks: int) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks, hash_block_size=4, enable_caching=True, hash_algo="sha256_cbor", hash_seed="0",
        enable_kv_cache_events=True, groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4)),
            pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=4, mamba_cache_mode="align")),
        ],
    )  # fmt: skip


def _state(client: KVCoordClient, pool: str) -> tuple[Any, ...]:
    s = client.inspect_pool(pool, all_requests=True)
    tables = {r.request_id: [list(g.block_ids) for g in r.groups] for r in s.requests}
    return s.num_free_blocks, list(s.free_queue_head), list(s.cached_block_ids), tables


def _clean(client: KVCoordClient, pool: str) -> bool:
    return list(client.check_pool(pool).violations) == []


def test_the_refusal_over_grpc_is_typed_changes_nothing_and_later_succeeds(client: KVCoordClient) -> None:
    client.create_pool("m", mamba_pool(8))
    sid, fence = attach(client, "m")
    # "z" holds 2 blocks (one per group): 5 free, vLLM's count for "a" is 5, it takes 6
    assert not client.allocate("m", allocate("z", [100], 1).allocate, sid, fence).result.refused
    before = _state(client, "m")
    assert before[0] == 5
    op = allocate("a", PROMPT, 12, num_external_computed_tokens=1)
    with pytest.raises(FailedPreconditionError) as err:
        client.allocate("m", op.allocate, sid, fence)
    assert err.value.reason == "UNCOUNTED_BLOCKS"
    assert "takes 6 blocks but only 5 are free; vLLM counts 5" in err.value.message
    (result,) = client.step("m", [op], sid, fence).results
    stepped = op_error(result)
    assert (type(stepped), stepped.reason) == (FailedPreconditionError, "UNCOUNTED_BLOCKS")
    assert _state(client, "m") == before and _clean(client, "m")
    # a block more free: the same allocation goes through, and its free returns everything
    client.step("m", [pb.Operation(free=pb.FreeOp(request_id="z"))], sid, fence)
    got = client.allocate("m", op.allocate, sid, fence)
    assert not got.result.refused
    assert _state(client, "m")[0] == 1 and _clean(client, "m")
    client.step("m", [pb.Operation(free=pb.FreeOp(request_id="a"))], sid, fence)
    assert _state(client, "m")[0] == 7 and _state(client, "m")[3] == {} and _clean(client, "m")


def test_a_predicted_session_raises_the_same_error_and_sends_nothing(client: KVCoordClient) -> None:
    client.create_pool("pm", mamba_pool(8))
    m = PredictingKVCacheManager(client, "pm", hash_seed="0", renew=False)
    z = hashed_req("z", [100])
    assert m.allocate_slots(z, 1) is not None
    z.num_computed_tokens = 1
    m.flush()
    before, mirror_free = _state(client, "pm"), m.mirror.num_free_blocks
    steps = m.steps_sent
    a = hashed_req("a", PROMPT)
    with pytest.raises(FailedPreconditionError) as err:
        m.allocate_slots(a, 12, num_external_computed_tokens=1)
    assert err.value.reason == "UNCOUNTED_BLOCKS"
    assert "takes 6 blocks but only 5 are free" in err.value.message
    assert m.mirror.num_free_blocks == mirror_free == 5 and not m.mirror.holds("a")
    m.flush()  # nothing of the refused call is sent: the server is as it was, no request lost
    assert _state(client, "pm") == before and _clean(client, "pm")
    assert m.steps_sent == steps
    m.free(z)
    told = m.allocate_slots(a, 12, num_external_computed_tokens=1)
    assert told is not None
    m.flush()
    assert _state(client, "pm")[3] == {"a": [list(g) for g in m.get_block_ids("a")]}
    assert _clean(client, "pm")
    m.free(a)
    m.flush()
    assert _state(client, "pm")[0] == 7 and _clean(client, "pm")
    m.close()


def test_the_mirror_and_the_server_refuse_with_the_same_type_and_reason(client: KVCoordClient) -> None:
    """An exclusive session's mirror (what a predicted session runs) and the server, for
    the same call on the same pool (the brief's: 6 blocks, 5 free): the same client
    error type and reason."""
    client.create_pool("mx", mamba_pool(6))
    att = client.attach(
        "mx", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True, want_engine_state=True
    )
    mirror = Mirror(client.get_pool("mx").pool.config, att.pool_state)
    mirror.engine.add_request("a", PROMPT, hashes(PROMPT))
    with pytest.raises(KVCoordError) as info:
        mirror.allocate("a", 12, 0, None, 0, 1)
    op = allocate("a", PROMPT, 12, num_external_computed_tokens=1)
    (r,) = client.step("mx", [op], att.session_id, att.fence).results
    servers = op_error(r)
    assert (type(info.value), info.value.reason) == (type(servers), servers.reason)
    assert (type(servers), servers.reason) == (FailedPreconditionError, "UNCOUNTED_BLOCKS")
    assert _state(client, "mx")[0] == mirror.num_free_blocks == 5 and _clean(client, "mx")
