"""vllm-0.33 KV cache zeroing without a mamba group (issue 25): a pool with
``needs_kv_cache_zeroing`` (vLLM 0.33 sets it for a mixed-precision KV cache) records
the blocks its attention groups take for ``take_new_block_ids``, the blocks of groups an
asynchronous load writes (``skip_zeroing_group_ids``) excepted."""

from __future__ import annotations

import pytest
from kvcoord.engine import (
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheConfig,
    KVCachePool,
    RequestNotFoundError,
)
from kvcoord.engine.specs import FullAttentionSpec, SlidingWindowSpec
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import config_from_pb


def zeroing_pool(zeroing: bool = True) -> KVCachePool:
    groups = (FullAttentionSpec(16, 2, 16, "float16"), SlidingWindowSpec(16, 32, 2, 16, "bfloat16"))
    return KVCachePool(
        KVCacheConfig(
            40,
            groups,
            16,
            enable_caching=False,
            profile="vllm-0.33",
            max_model_len=1024,
            max_in_flight_tokens=256,
            needs_kv_cache_zeroing=zeroing,
        )  # fmt: skip
    )


def test_new_blocks_to_zero_are_vllm_033s() -> None:
    """The ids vLLM 0.33.0's own KVCacheManager answers for the same calls, in its venv
    (/var/cache/kvcoord/vllm033-venv): a KVCacheConfig of a float16 full-attention
    group (block 16) and a bfloat16 sliding-window group (block 16, window 32), 40
    blocks, so ``needs_kv_cache_zeroing`` is True (mixed precision);
    ``KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=16,
    hash_block_size=16, max_in_flight_tokens=256, enable_caching=False)``; requests
    ``Request(rid, list(range(n)), SamplingParams(max_tokens=10), None, None)`` and
    these ``allocate_slots`` / ``free`` / ``take_new_block_ids`` calls in this order.
    vLLM answered: [1, 2, 3, 4, 5, 6], then [9, 10] (b's external blocks of group 0
    are skipped: an async load writes them), then [11, 12, 15, 14, 13, 14, 16, 13]."""
    p = zeroing_pool()
    p.add_request("a", list(range(40)))
    assert p.allocate_slots("a", 40) == ((1, 2, 3), (4, 5, 6))
    assert p.take_new_block_ids() == [1, 2, 3, 4, 5, 6]
    p.add_request("b", list(range(50)))
    got = p.allocate_slots(
        "b", 0, num_external_computed_tokens=32, delay_cache_blocks=True, skip_zeroing_group_ids=(0,)
    )
    assert got == ((), ())
    assert p.take_new_block_ids() == [9, 10]
    p.add_request("c", list(range(20)))
    assert p.allocate_slots("c", 20) == ((11, 12), (13, 14))
    p.update_request("a", num_computed_tokens=40, append_token_ids=[7] * 10)
    assert p.allocate_slots("a", 10) == ((15,), (16,))
    p.free("c")
    p.add_request("d", list(range(30)))
    assert p.allocate_slots("d", 0, num_external_computed_tokens=16) == ((), ())
    assert p.take_new_block_ids() == [11, 12, 15, 14, 13, 14, 16, 13]
    assert p.take_new_block_ids() == []


def test_without_the_flag_nothing_is_recorded() -> None:
    p = zeroing_pool(zeroing=False)
    p.add_request("a", list(range(40)))
    assert p.allocate_slots("a", 40) is not None
    assert p.take_new_block_ids() == []


@pytest.mark.parametrize("caching", [False, True])
def test_a_lone_full_attention_group_records_its_decode_blocks(caching: bool) -> None:
    """One full-attention group (whose allocations otherwise take the pool's direct
    path): the prompt's blocks, then a decode step's, by allocate_slots and by
    update_and_allocate (a decode step's call over the wire)."""
    p = KVCachePool(
        KVCacheConfig(
            16,
            (FullAttentionSpec(16),),
            16,
            enable_caching=caching,
            profile="vllm-0.33",
            needs_kv_cache_zeroing=True,
            hash_length=1 if caching else None,
        )  # fmt: skip
    )
    hashes = [bytes([i]) for i in range(2)] if caching else []
    p.add_request("a", list(range(40)), hashes)
    assert p.allocate_slots("a", 40) == ((1, 2, 3),)
    p.update_request(
        "a", num_computed_tokens=40, append_token_ids=list(range(9)), append_block_hashes=[b"\x08"] * caching
    )
    assert p.allocate_slots("a", 9) == ((4,),)
    assert p.take_new_block_ids() == [1, 2, 3, 4]
    assert p.update_and_allocate("a", 49, list(range(16)), [b"\x09"] * caching, 16) == ((5,),)
    assert p.take_new_block_ids() == [5]


def test_the_flag_and_the_skip_are_vllm_033_inputs_checked() -> None:
    groups = (FullAttentionSpec(16),)
    with pytest.raises(ConfigError, match="needs_kv_cache_zeroing is a vLLM 0.33 field"):
        KVCacheConfig(8, groups, 16, needs_kv_cache_zeroing=True)
    p016 = KVCachePool(KVCacheConfig(8, groups, 16, enable_caching=False))
    p016.add_request("a", list(range(20)))
    with pytest.raises(InvalidArgumentError, match="skip_zeroing_group_ids is a vLLM 0.33 input"):
        p016.allocate_slots("a", 20, skip_zeroing_group_ids=(0,))
    p = zeroing_pool()
    p.add_request("a", list(range(20)))
    with pytest.raises(InvalidArgumentError, match="2 is not a group of this pool"):
        p.allocate_slots("a", 0, num_external_computed_tokens=16, skip_zeroing_group_ids=(2,))
    assert p.get_block_ids("a") == ((), ()) and p.take_new_block_ids() == []


def test_the_flag_travels_in_the_pool_config() -> None:
    wire = pb.PoolConfig(
        num_blocks=8, hash_block_size=16, profile="vllm-0.33", needs_kv_cache_zeroing=True,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=16))],
    )  # fmt: skip
    assert config_from_pb(wire).needs_kv_cache_zeroing
    wire.needs_kv_cache_zeroing = False
    assert not config_from_pb(wire).needs_kv_cache_zeroing


def test_blocks_a_failed_load_left_are_recorded_again_as_vllm_033_does() -> None:
    """vLLM 0.33's ``record_blocks_for_zeroing`` (its scheduler calls it when an
    asynchronous KV load failed but left computed tokens). The ids vLLM 0.33.0's own
    KVCacheManager answered in its venv for the pool of
    :func:`test_new_blocks_to_zero_are_vllm_033s`: ``a`` (50 tokens) takes blocks for 48
    external tokens with ``skip_zeroing_group_ids=(0, 1)`` (nothing recorded), ``b`` (40)
    allocates ([6, 7, 8, 9, 10, 11] to zero); then ``record_blocks_for_zeroing("a", s)``
    and ``take_new_block_ids()`` for s = 16: [2, 3, 4, 5]; 48: []; 0: [1, 2, 3, 0, 4, 5]
    (the window's null block, id 0, included); 64: []."""
    p = zeroing_pool()
    p.add_request("a", list(range(50)))
    got = p.allocate_slots(
        "a", 0, num_external_computed_tokens=48, delay_cache_blocks=True, skip_zeroing_group_ids=(0, 1)
    )
    assert got == ((), ()) and p.take_new_block_ids() == []
    p.add_request("b", list(range(40)))
    assert p.allocate_slots("b", 40) == ((6, 7, 8), (9, 10, 11))
    assert p.take_new_block_ids() == [6, 7, 8, 9, 10, 11]
    assert p.get_block_ids("a") == ((1, 2, 3), (0, 4, 5))
    for start, ids in ((16, [2, 3, 4, 5]), (48, []), (0, [1, 2, 3, 0, 4, 5]), (64, [])):
        p.record_blocks_for_zeroing("a", start)
        assert p.take_new_block_ids() == ids, start


def test_recording_for_zeroing_is_refused_when_vllm_033_would_not_do_it() -> None:
    """A start not aligned to a recording group's block (vLLM 0.33.0 asserts, after it
    recorded the earlier groups': refused here with nothing recorded), an unknown
    request, a vllm-0.16 pool; a pool that records nothing records nothing."""
    p = KVCachePool(
        KVCacheConfig(
            40, (FullAttentionSpec(16, 2, 16, "float16"), SlidingWindowSpec(32, 32, 2, 16, "bfloat16")), 16,
            enable_caching=False, profile="vllm-0.33", max_model_len=1024, max_in_flight_tokens=256,
            needs_kv_cache_zeroing=True,
        )
    )  # fmt: skip
    p.add_request("a", list(range(50)))
    assert p.allocate_slots("a", 50) == ((1, 2, 3, 4), (5, 6))
    assert p.take_new_block_ids() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(InvalidArgumentError, match="not a multiple of group 1's block size 32"):
        p.record_blocks_for_zeroing("a", 16)
    assert p.take_new_block_ids() == []
    p.record_blocks_for_zeroing("a", 32)  # vLLM 0.33.0: [3, 4, 6]
    assert p.take_new_block_ids() == [3, 4, 6]
    with pytest.raises(RequestNotFoundError):
        p.record_blocks_for_zeroing("x", 0)
    with pytest.raises(InvalidArgumentError, match="start_token"):
        p.record_blocks_for_zeroing("a", -16)
    p016 = KVCachePool(KVCacheConfig(8, (FullAttentionSpec(16),), 16, enable_caching=False))
    p016.add_request("a", list(range(20)))
    with pytest.raises(FailedPreconditionError, match="record_blocks_for_zeroing is a vllm-0.33 call"):
        p016.record_blocks_for_zeroing("a", 0)
    quiet = zeroing_pool(zeroing=False)
    quiet.add_request("a", list(range(40)))
    assert quiet.allocate_slots("a", 40) is not None
    quiet.record_blocks_for_zeroing("a", 0)
    assert quiet.take_new_block_ids() == []
