"""A vllm-0.16 pool's refusal of a first allocation with external (KV connector) tokens
that would hand a later group's free hit block to an earlier group too
(tests/unit/test_hit_block_taken.py), over real gRPC: the Allocate RPC (with the pool's
atomic lookup) and the Step operation answer FAILED_PRECONDITION, reason
HIT_BLOCK_TAKEN, with the pool unchanged and clean; an exclusive session's mirror (what a
predicted session runs) raises the same client error type and reason.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import FailedPreconditionError, KVCoordClient
from kvcoord.client.answers import op_error
from kvcoord.client.errors import KVCoordError
from kvcoord.client.mirror import Mirror
from kvcoord.v1 import allocator_pb2 as pb

PREFIX = list(range(1, 9))
PROMPT = PREFIX + [9, 10, 11, 12, 13]


def mamba_first_pool(num_blocks: int) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks, hash_block_size=4, enable_caching=True, hash_algo="sha256_cbor", hash_seed="0",
        groups=[
            pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=4, mamba_cache_mode="align")),
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4)),
        ],
    )  # fmt: skip


def _state(client: KVCoordClient, pool: str) -> tuple[Any, ...]:
    s = client.inspect_pool(pool, 32, all_requests=True, include_cached_blocks=True)
    tables = {r.request_id: [list(g.block_ids) for g in r.groups] for r in s.requests}
    return s.num_free_blocks, list(s.free_queue_head), list(s.cached_block_ids), tables


def _build(client: KVCoordClient, pool: str, sid: str, fence: pb.Fence) -> None:
    """p0 (the prompt's first block, freed), q (freed behind it), p (the prefix, no hit,
    running), 5 holders: the full group's hit is [2, 11] with block 2 at the queue's head."""

    def ok(op: pb.Operation) -> None:
        (r,) = client.step(pool, [op], sid, fence).results
        assert not r.status_code, r.status_message

    ok(allocate("p0", PREFIX[:4] + [50, 51, 52, 53], 8))
    ok(allocate("q", list(range(200, 217)), 16))
    ok(pb.Operation(free=pb.FreeOp(request_id="p0")))
    ok(pb.Operation(free=pb.FreeOp(request_id="q")))
    ok(allocate("p", PREFIX + [99], 8))
    for k in range(5):
        ok(allocate(f"h{k}", [1000 + k, 2000 + k, 3000 + k], 3))


def test_the_refusal_over_grpc_is_typed_and_changes_nothing(client: KVCoordClient) -> None:
    client.create_pool("hb", mamba_first_pool(20))
    sid, fence = attach(client, "hb")
    _build(client, "hb", sid, fence)
    before = _state(client, "hb")
    assert before[1][:2] == [2, 4]
    op = allocate("e", PROMPT, 12, num_external_computed_tokens=1, lookup=True)
    with pytest.raises(FailedPreconditionError) as err:
        client.allocate("hb", op.allocate, sid, fence)
    assert err.value.reason == "HIT_BLOCK_TAKEN"
    assert "block 2 (group 1's hit) by group 0" in err.value.message
    (result,) = client.step("hb", [op], sid, fence).results
    stepped = op_error(result)
    assert (type(stepped), stepped.reason) == (FailedPreconditionError, "HIT_BLOCK_TAKEN")
    assert _state(client, "hb") == before
    assert list(client.check_pool("hb").violations) == []


def test_the_mirror_and_the_server_refuse_with_the_same_type_and_reason(client: KVCoordClient) -> None:
    """An exclusive session's mirror, given the same calls as the server (the mirror's
    engine is the server's), refuses the same allocation with the server's error type
    and reason."""
    client.create_pool("hx", mamba_first_pool(20))
    att = client.attach(
        "hx", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True, want_engine_state=True
    )
    mirror = Mirror(client.get_pool("hx").pool.config, att.pool_state)
    _build(client, "hx", att.session_id, att.fence)
    ours = mirror.engine
    for rid, tokens, n in [("p0", PREFIX[:4] + [50, 51, 52, 53], 8), ("q", list(range(200, 217)), 16)]:
        ours.add_request(rid, tokens, hashes(tokens), cache_namespace=mirror.namespace)
        assert mirror.allocate(rid, n) is not None
    mirror.free_if_held("p0")
    mirror.free_if_held("q")
    todo = [("p", PREFIX + [99], 8)] + [(f"h{k}", [1000 + k, 2000 + k, 3000 + k], 3) for k in range(5)]
    for rid, tokens, n in todo:
        ours.add_request(rid, tokens, hashes(tokens), cache_namespace=mirror.namespace)
        assert mirror.allocate(rid, n) is not None
    assert ours.free_queue_head() == _state(client, "hx")[1]
    ours.add_request("e", PROMPT, hashes(PROMPT), cache_namespace=mirror.namespace)
    hit = ours.get_computed_blocks("e")
    assert (hit.num_tokens, hit.block_ids) == (8, ((0, 9), (2, 11)))
    with pytest.raises(KVCoordError) as info:
        mirror.allocate("e", len(PROMPT) - hit.num_tokens - 1, hit.num_tokens, hit, 0, 1)
    op = allocate("e", PROMPT, 12, num_external_computed_tokens=1, lookup=True)
    (r,) = client.step("hx", [op], att.session_id, att.fence).results
    servers = op_error(r)
    assert (type(info.value), info.value.reason) == (type(servers), servers.reason)
    assert (type(servers), servers.reason) == (FailedPreconditionError, "HIT_BLOCK_TAKEN")
