"""vllm-0.33 mamba groups in the engine (MambaManager033) and their wire form: what the
conformance trace and the differential run against vLLM 0.33 do not pin down alone."""

from __future__ import annotations

import pytest
from kvcoord.engine import FailedPreconditionError, KVCacheConfig, KVCachePool
from kvcoord.engine.invariants import check_pool
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


@pytest.mark.parametrize(
    ("profile", "blocks", "alignment", "message"),
    [
        ("vllm-0.16", 1, 1, "prefill checkpoint blocks are a vLLM 0.33 field"),
        ("vllm-0.33", -1, 1, "num_prefill_checkpoint_blocks must be >= 0"),
        ("vllm-0.33", 1, 0, "prefill_checkpoint_alignment"),
    ],
)
def test_prefill_checkpoint_fields_are_checked(
    profile: str, blocks: int, alignment: int, message: str
) -> None:
    """A mamba group's prefill checkpoint fields exist only under vllm-0.33, and in range."""
    from kvcoord.engine import ConfigError

    spec = MambaSpec(32, MambaCacheMode.ALIGN, num_prefill_checkpoint_blocks=blocks,
                     prefill_checkpoint_alignment=alignment)  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        KVCachePool(KVCacheConfig(40, (FullAttentionSpec(32), spec), 32, profile=profile, max_model_len=1024))


def test_a_prefill_checkpoint_step_keeps_the_column_before_the_state_block() -> None:
    """vLLM 0.33 with one prefill checkpoint block (alignment 1): a 100-token prompt in
    one chunk keeps a live block at column cdiv(100, 32) - 2 = 2 (the state at 96, the
    prompt's reusable boundary, hashed there) beside the running state block at 3;
    without checkpoint blocks that column is null. The expected tables are vLLM 0.33.0's
    own manager's for the same calls (its venv: tests/with_vllm/test_mamba033_engine.py's
    ``_Both("align", True, 0, num_blocks=40, ckpt=1 or None)``, add "a" with
    ``range(100)``, admit with budget 192, ``theirs.get_block_ids("a")``: full group
    [1, 2, 3, 4], mamba group [0, 0, 5, 6] and [0, 0, 0, 5])."""
    for blocks, expected in ((1, [0, 0, 5, 6]), (0, [0, 0, 0, 5])):
        spec = MambaSpec(32, MambaCacheMode.ALIGN, num_prefill_checkpoint_blocks=blocks,
                         prefill_checkpoint_alignment=1)  # fmt: skip
        p = KVCachePool(
            KVCacheConfig(40, (FullAttentionSpec(32), spec), 32, profile="vllm-0.33", max_model_len=1024)
        )
        p.add_request("a", list(range(100)), hashes(3))
        assert p.allocate_slots("a", 100) is not None
        table = p.get_block_ids("a")
        assert list(table[1]) == expected
        assert (table[1][2] in p.cached_block_ids()) == bool(blocks)


@pytest.mark.parametrize("alignment", [None, 1, 64])
def test_prefill_checkpoint_fields_travel_on_the_wire(alignment: int | None) -> None:
    """PoolConfig's MambaSpec carries num_prefill_checkpoint_blocks and the optional
    prefill_checkpoint_alignment (unset: None, the backend cannot export) to the engine."""
    from kvcoord.v1 import allocator_pb2 as pb
    from kvcoord.wire import config_from_pb

    mamba = pb.MambaSpec(block_size=32, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                         prefill_checkpoint_alignment=alignment)  # fmt: skip
    cfg = pb.PoolConfig(
        num_blocks=40, hash_block_size=32, max_model_len=1024, profile="vllm-0.33",
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=32)), pb.KVCacheGroupSpec(mamba=mamba)],
    )  # fmt: skip
    spec = config_from_pb(cfg).groups[1]
    assert isinstance(spec, MambaSpec)
    assert (spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment) == (1, alignment)


def test_a_planned_prefill_checkpoint_survives_the_state_export() -> None:
    """A prefill checkpoint planned by an allocation whose caching is delayed (a KV
    connector's asynchronous load) is keyed by the later cache_blocks: the pool's state
    as a value (snapshots, Attach's engine state) carries it, so a pool restored from it
    keys the same block at the same boundary as the pool it was taken from."""
    from kvcoord.engine.state import export_state, import_state

    spec = MambaSpec(
        32, MambaCacheMode.ALIGN, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1
    )
    config = KVCacheConfig(40, (FullAttentionSpec(32), spec), 32, profile="vllm-0.33", max_model_len=1024)
    p = KVCachePool(config)
    p.add_request("a", list(range(100)), hashes(3))
    assert p.allocate_slots("a", 100, delay_cache_blocks=True) is not None
    assert p.managers[1].checkpoints  # planned, not yet keyed
    q = import_state(config, export_state(p))
    assert q.managers[1].checkpoints == p.managers[1].checkpoints
    assert q.snapshot() == p.snapshot()
    p.cache_blocks("a", 100)
    q.cache_blocks("a", 100)
    assert q.snapshot() == p.snapshot()
    assert q.cached_block_ids() == p.cached_block_ids()


def test_a_pool_check_of_a_mamba_pool_without_caching_holding_a_request() -> None:
    """vLLM 0.33 runs a mamba group outside "align" mode with prefix caching off, and the
    pool's hash block is then the mamba block (1,024 tokens), larger than the attention
    group's (16). Its check (CheckPool, ``kvcoord check``) with a live request finds
    nothing wrong; before, it failed with ZeroDivisionError (gRPC INTERNAL): it merged
    the request's hashes to the smaller block, which only a caching pool reads."""
    spec = MambaSpec(1024, MambaCacheMode.NONE)
    p = KVCachePool(
        KVCacheConfig(
            40,
            (FullAttentionSpec(16), spec),
            1024,
            enable_caching=False,
            profile="vllm-0.33",
            max_model_len=4096,
        )
    )
    p.add_request("a", list(range(100)), [])
    assert p.allocate_slots("a", 100) is not None
    got = check_pool(p)
    assert got.violations == () and got.num_requests == 1
