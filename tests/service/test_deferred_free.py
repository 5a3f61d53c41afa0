"""vLLM 0.33's deferred free over real gRPC: ``FreeOp.all_groups_reversed`` frees a
request in the order of vLLM 0.33's ``pop_blocks_for_free`` + ``block_pool.free_blocks``
(all groups' blocks in one reversed pass), which a KV-consumer connector's frees take
under the async scheduler; a vllm-0.16 pool refuses it and keeps the request."""

from __future__ import annotations

from kvcoord.client import KVCoordClient
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.v1 import allocator_pb2 as pb
from workload import pool_config

NUM_BLOCKS = 32


def pool(profile: str) -> pb.PoolConfig:
    cfg = pool_config(NUM_BLOCKS)  # full attention and a sliding window, blocks of 16 tokens
    cfg.profile = profile
    return cfg


def hashes(n: int, salt: int) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


def allocate(rid: str, tokens: int, salt: int) -> pb.Operation:
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=list(range(tokens)), append_block_hashes=hashes(tokens // 16, salt),
        new_request=True,
    )  # fmt: skip
    return pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=tokens))


def run(client: KVCoordClient, name: str, deferred: bool) -> list[list[int]]:
    """Allocate a request (3 hashed blocks and a partial one per group), free it, then
    allocate one that takes every free block: its table shows the free queue's order."""
    client.create_pool(name, pool("vllm-0.33"))
    att = client.attach(name, "sha256_cbor", 16, "0", profile="vllm-0.33")
    free = pb.Operation(free=pb.FreeOp(request_id="a", all_groups_reversed=deferred))
    big = (NUM_BLOCKS - 1) // 2 * 16
    results = client.step(
        name, [allocate("a", 56, 1), free, allocate("b", big, 2)], att.session_id, att.fence
    )
    assert all(r.status_code == 0 for r in results.results), results
    return [list(g.block_ids) for g in results.results[2].allocate.new_block_ids]


def engine_table(deferred: bool) -> list[list[int]]:
    """The same calls on the engine (the rule, unit-tested in test_profile_rules)."""
    groups = (FullAttentionSpec(16), SlidingWindowSpec(16, 64))
    p = KVCachePool(KVCacheConfig(NUM_BLOCKS, groups, 16, enable_caching=True, profile="vllm-0.33"))
    p.add_request("a", list(range(56)), hashes(3, 1))
    p.allocate_slots("a", 56)
    p.free("a", all_groups_reversed=deferred)
    big = (NUM_BLOCKS - 1) // 2 * 16
    p.add_request("b", list(range(big)), hashes(big // 16, 2))
    table = p.allocate_slots("b", big)
    assert table is not None
    return [list(g) for g in table]


def test_a_deferred_free_frees_in_vllm_033s_order(client: KVCoordClient) -> None:
    plain, deferred = run(client, "plain", False), run(client, "deferred", True)
    assert plain == engine_table(False)
    assert deferred == engine_table(True)
    assert plain != deferred  # the order is visible in the blocks handed out next


def test_a_deferred_free_is_refused_by_a_016_pool(client: KVCoordClient) -> None:
    cfg = pool("")
    client.create_pool("old", cfg)
    att = client.attach("old", "sha256_cbor", 16, "0")
    free = pb.Operation(free=pb.FreeOp(request_id="a", all_groups_reversed=True))
    results = client.step("old", [allocate("a", 56, 1), free], att.session_id, att.fence).results
    assert results[0].status_code == 0
    assert results[1].status_code == 9 and "vllm-0.33" in results[1].status_message  # FAILED_PRECONDITION
    assert client.get_pool("old").pool.num_requests == 1  # still held
