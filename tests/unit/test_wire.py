"""kvcoord.wire, the one copy of the conversions both sides make: every engine value
survives its message and back, values made by a real pool included, and the contract
facts agree with the code that depends on them."""

from __future__ import annotations

import pytest
from kvcoord.client.hashing import HASH_ALGORITHMS, hash_function
from kvcoord.engine import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheHit,
    EngineError,
    ErrorStatus,
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    PrefixCacheStats,
    SlidingWindowSpec,
)
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import (
    HASH_LENGTHS,
    ConfigFileError,
    WireError,
    add_events,
    config_from_pb,
    event_from_pb,
    event_to_pb,
    events_digest,
    events_from_pb,
    events_message_digest,
    group_kinds,
    hit_from_pb,
    hit_to_pb,
    pool_config_from_table,
    pool_state_from_pb,
    stats_from_pb,
    stats_to_pb,
    write_pool_state,
)

H = [bytes([i]) * 32 for i in range(4)]


def _pool_with_history() -> KVCachePool:
    """A real pool that cached, freed, evicted and reset: its events and stats are the
    engine's own, not values written here."""
    cfg = KVCacheConfig(
        num_blocks=9, groups=(FullAttentionSpec(4),), hash_block_size=4, max_model_len=64,
        enable_caching=True, enable_kv_cache_events=True, hash_length=32,
    )  # fmt: skip
    pool = KVCachePool(cfg)
    pool.add_request("a", list(range(9)), H[:2])
    assert pool.allocate_slots("a", 9) is not None
    pool.free("a")
    pool.add_request("b", list(range(9)), H[:2])
    hit = pool.get_computed_blocks("b")
    assert pool.allocate_slots("b", 9 - hit.num_tokens, hit.num_tokens, hit) is not None
    pool.free("b")
    pool.add_request("c", [7] * 30, [bytes([100 + i]) * 32 for i in range(7)])
    assert pool.allocate_slots("c", 30) is not None  # takes the cached blocks back: BlockRemoved
    pool.free("c")
    assert pool.reset_prefix_cache()
    return pool


def test_events_a_real_pool_made_survive_the_wire() -> None:
    pool = _pool_with_history()
    events = pool.take_events()
    assert {type(e) for e in events} == {BlockStored, BlockRemoved, AllBlocksCleared}
    messages = [event_to_pb(e) for e in events]
    assert events_from_pb(messages) == events
    holder = pb.StepResponse()
    add_events(holder.events, events)
    assert list(holder.events) == messages
    # The digest the server sends is the digest a client computes over what it holds.
    assert events_digest(events) == events_message_digest(holder)
    assert events_digest(events[:-1]) != events_digest(events)


def test_every_optional_event_field_travels() -> None:
    stored = BlockStored((H[1], H[2]), H[0], (1, 2, 3, 4, 5, 6, 7, 8), 4, 3, "adapter", "CPU")
    assert event_from_pb(event_to_pb(stored)) == stored
    bare = BlockStored((H[1],), None, (1, 2, 3, 4), 4, None, None)
    message = event_to_pb(bare)
    assert not message.block_stored.HasField("parent_block_hash")
    assert not message.block_stored.HasField("lora_id")
    assert event_from_pb(message) == bare


def test_an_event_message_without_an_event_is_refused() -> None:
    with pytest.raises(WireError, match="no event"):
        event_from_pb(pb.KVEvent())


def test_statistics_survive_the_wire() -> None:
    pool = _pool_with_history()
    stats = pool.make_prefix_cache_stats()
    assert stats is not None and stats.requests and stats.hits and stats.reset
    message = stats_to_pb(stats)
    assert message is not None
    assert stats_from_pb(message) == stats
    assert stats_to_pb(None) is None
    assert stats_from_pb(pb.PrefixCacheStats()) == PrefixCacheStats()


def test_hits_survive_the_wire() -> None:
    hit = CacheHit(((3, 4), (0, 7)), 8)
    assert hit_from_pb(hit_to_pb(hit)) == hit
    assert hit_from_pb(pb.CacheHit()) is None


def test_a_pool_state_survives_the_attach_answer() -> None:
    pool = _pool_with_history()
    pool.add_request("d", list(range(9)), H[:2])
    assert pool.allocate_slots("d", 9) is not None
    pool.free("d")
    state = pool.replica_state()
    assert not isinstance(state, str) and state[2], state
    response = pb.AttachResponse()
    write_pool_state(response, state)
    assert pool_state_from_pb(response) == state
    why = pb.AttachResponse()
    write_pool_state(why, "the pool holds requests")
    assert pool_state_from_pb(why) == "the pool holds requests"


def test_hash_lengths_are_the_digests_the_client_computes() -> None:
    assert set(HASH_LENGTHS) == set(HASH_ALGORITHMS)
    for algo, length in HASH_LENGTHS.items():
        assert len(hash_function(algo)((b"", (1, 2, 3), None))) == length, algo


def test_layouts_from_the_table_form_to_the_engine() -> None:
    table = {
        "name": "ignored", "num_blocks": 64, "hash_block_size": 16, "enable_caching": True,
        "hash_algo": "xxhash", "hash_seed": "0", "max_model_len": 256,
        "groups": [
            {"type": "full", "block_size": 16},
            {"type": "sliding_window", "block_size": 16, "sliding_window": 64},
            {"type": "mamba", "block_size": 32, "mamba_cache_mode": "align"},
        ],
    }  # fmt: skip
    message = pool_config_from_table(table, "pools[0]")
    assert group_kinds(message.groups) == ["full", "sliding_window", "mamba"]
    engine = config_from_pb(message)
    assert engine.hash_length == 16 and engine.max_model_len == 256
    assert engine.groups[:2] == (FullAttentionSpec(16), SlidingWindowSpec(16, 64))
    assert (
        isinstance(engine.groups[2], MambaSpec) and engine.groups[2].mamba_cache_mode is MambaCacheMode.ALIGN
    )
    with pytest.raises(ConfigFileError, match=r"pools\[0\]\.groups\[0\]\.type: unknown group type 'dense'"):
        pool_config_from_table({"groups": [{"type": "dense"}]}, "pools[0]")
    with pytest.raises(ConfigFileError, match="must be a list of strings"):
        pool_config_from_table({"shared_cache_tenants": "a"}, "pools[0]")


def test_eagle_group_ids_reach_the_engine() -> None:
    """vLLM 0.33's is_eagle_group flags (PoolConfig.eagle_group_ids), from the table form
    and the wire, pick the groups whose hits drop EAGLE's block."""
    table = {
        "num_blocks": 64, "hash_block_size": 16, "enable_caching": True, "hash_algo": "xxhash", "hash_seed": "0",
        "use_eagle": True, "profile": "vllm-0.33", "eagle_group_ids": [1],
        "groups": [{"type": "full", "block_size": 16}, {"type": "sliding_window", "block_size": 16, "sliding_window": 64}],
    }  # fmt: skip
    engine = config_from_pb(pool_config_from_table(table, "pools[0]"))
    assert engine.eagle_group_ids == (1,) and engine.eagle_drop_groups == {1}
    assert config_from_pb(
        pool_config_from_table({**table, "eagle_group_ids": []}, "p")
    ).eagle_drop_groups == {0, 1}
    with pytest.raises(ConfigFileError, match=r"pools\[0\]\.eagle_group_ids: must be a list"):
        pool_config_from_table({"eagle_group_ids": 1}, "pools[0]")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            pb.PoolConfig(num_blocks=8, hash_block_size=4, groups=[pb.KVCacheGroupSpec()]),
            "groups.0. has no spec",
        ),
        (pb.PoolConfig(enable_caching=True, hash_algo="md5", hash_seed="0"), "hash_algo must be one of"),
        (pb.PoolConfig(enable_caching=True, hash_algo="sha256"), "hash_seed is required"),
        (
            pb.PoolConfig(
                groups=[pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=4, mamba_cache_mode="x"))]
            ),
            "mamba_cache_mode must be none, all or align",
        ),
    ],
)
def test_a_config_no_engine_value_can_be_made_from_is_an_invalid_argument(
    config: pb.PoolConfig, message: str
) -> None:
    """WireError is an engine error of status INVALID_ARGUMENT: the server maps it so
    without knowing the wire module (tests/service/test_pools.py checks the status)."""
    with pytest.raises(WireError, match=message) as caught:
        config_from_pb(config)
    assert isinstance(caught.value, EngineError) and caught.value.status is ErrorStatus.INVALID_ARGUMENT
