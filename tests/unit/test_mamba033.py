"""vllm-0.33 mamba groups in the engine (MambaManager033) and their wire form: what the
conformance trace and the differential run against vLLM 0.33 do not pin down alone."""

from __future__ import annotations

import pytest
from kvcoord.engine import FailedPreconditionError, KVCacheConfig, KVCachePool
from kvcoord.engine.specs import FullAttentionSpec, MambaCacheMode, MambaSpec
from kvcoord.wire import copies_from_pb, copies_to_pb, offloads_from_pb, offloads_to_pb


def mamba_pool(profile: str = "vllm-0.33") -> KVCachePool:
    spec = MambaSpec(32, MambaCacheMode.ALIGN)
    return KVCachePool(
        KVCacheConfig(40, (FullAttentionSpec(32), spec), 32, profile=profile, max_model_len=1024)
    )


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def test_the_drains_drain_and_name_what_was_allocated() -> None:
    """take_new_block_ids answers the full-attention blocks the allocations took (not the
    mamba ones), take_boundary_state_offloads the mamba blocks hashed with their boundary,
    each once; a second take is empty. (As vLLM 0.33's scheduler does for mamba, the
    prompt is split at its replay boundary, 96 tokens, so the state there is kept.)"""
    p = mamba_pool()
    p.add_request("a", list(range(100)), hashes(3))
    got = p.allocate_slots("a", 96)
    assert got is not None
    assert p.take_new_block_ids() == list(got[0])
    assert p.take_new_block_ids() == []
    table = p.get_block_ids("a")
    offloads = p.take_boundary_state_offloads()
    assert offloads == {"a": [(1, table[1][2], 96)]}  # the replay boundary's state block
    assert table[1][2] in p.cached_block_ids()
    assert p.take_boundary_state_offloads() == {}
    assert p.take_kv_cache_block_copies() == ([], [])


def test_a_freed_requests_hand_offs_are_dropped() -> None:
    """Once freed, a request's blocks may go to another request: its untaken boundary
    states are not handed over."""
    p = mamba_pool()
    p.add_request("a", list(range(100)), hashes(3))
    p.add_request("b", list(range(200, 300)), [bytes([100 + i]) * 32 for i in range(3)])
    assert p.allocate_slots("a", 96) is not None
    assert p.allocate_slots("b", 96) is not None
    p.free("a")
    assert set(p.take_boundary_state_offloads()) == {"b"}


def test_a_hit_on_a_state_cached_this_step_waits_for_the_next_step() -> None:
    """The same-step refusal: a lookup finds the state block another request cached in
    this step, but adopting it is refused, changing nothing, until new_step_starts."""
    p = mamba_pool()
    p.add_request("a", list(range(100)), hashes(3))
    assert p.allocate_slots("a", 96) is not None
    p.add_request("b", list(range(100)), hashes(3))
    hit = p.get_computed_blocks("b")
    assert hit.num_tokens == 96
    before = (p.free_queue_head(), p.block_pool.ref_cnts(), p.cached_block_ids())
    assert p.allocate_slots("b", 4, hit.num_tokens, hit) is None
    assert (p.free_queue_head(), p.block_pool.ref_cnts(), p.cached_block_ids()) == before
    assert p.get_block_ids("b") == ((), ())
    p.new_step_starts()
    assert p.allocate_slots("b", 4, hit.num_tokens, hit) is not None


def test_a_016_pool_refuses_the_033_drains() -> None:
    p = mamba_pool("vllm-0.16")
    for call in (p.take_new_block_ids, p.take_boundary_state_offloads, p.take_kv_cache_block_copies):
        with pytest.raises(FailedPreconditionError, match="is a vllm-0.33 call"):
            call()


def test_hand_offs_and_copies_survive_the_wire() -> None:
    offloads = {"a": [(1, 7, 96), (1, 9, 160)], "b": [(2, 3, 32)]}
    assert offloads_from_pb(offloads_to_pb(offloads)) == offloads
    assert offloads_from_pb(offloads_to_pb({})) == {}
    assert copies_from_pb(copies_to_pb([(4, 5), (6, 8)], [4, 5, 6, 8])) == ([(4, 5), (6, 8)], [4, 5, 6, 8])
