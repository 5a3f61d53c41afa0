"""kvcoord.client.vllm without vLLM installed: blocks, pool configs from vLLM-shaped
configs, the connect-time check, plain stats and events (tests/with_vllm use vLLM itself)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import support
from kvcoord.client import PoolBusyError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.vllm import (
    KVCacheBlock,
    KVCacheBlocks,
    PoolMismatchError,
    Settings,
    connect,
    convert_events,
    convert_stats,
    pool_config_differences,
    pool_config_from_vllm,
)
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb


@dataclasses.dataclass
class FullAttentionSpec:  # dispatch is by vLLM's class name
    block_size: int
    num_kv_heads: int = 2
    head_size: int = 16
    dtype: str = "float16"


@dataclasses.dataclass
class SlidingWindowSpec:
    block_size: int
    sliding_window: int
    num_kv_heads: int = 2
    head_size: int = 16
    dtype: str = "float16"


def engine(num_blocks: int = 32, *, events: bool = True, caching: bool = True) -> tuple[Any, Any]:
    """(kv_cache_config, vllm_config) with the attributes vLLM's have."""
    kv = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=FullAttentionSpec(4)),
            SimpleNamespace(kv_cache_spec=SlidingWindowSpec(4, 8)),
        ],
    )
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=4, enable_prefix_caching=caching, prefix_caching_hash_algo="sha256"
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=events),
        speculative_config=None,
        model_config=SimpleNamespace(max_model_len=256),
    )
    return kv, cfg


@dataclasses.dataclass
class Req(support.Req):
    """support's Req with the block hashes and num_tokens vLLM's Request has."""

    block_hashes: list[bytes] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def test_blocks_interface() -> None:
    """+, new_empty, get_block_ids(allow_none) and get_unhashed_block_ids as vLLM's."""
    a = KVCacheBlocks(([KVCacheBlock(1, b"h"), KVCacheBlock(2)],))
    b = KVCacheBlocks(([KVCacheBlock(3)],))
    assert (a + b).get_block_ids() == ([1, 2, 3],)
    assert a.new_empty().get_block_ids(allow_none=True) is None
    assert a.new_empty().get_block_ids() == ([],)
    assert a.get_block_ids(allow_none=True) == ([1, 2],)
    assert a.get_unhashed_block_ids() == [2]
    assert a.blocks[0][0].block_hash == b"h" and not a.blocks[0][0].is_null


def test_pool_config_from_engine_and_differences() -> None:
    """Groups, sizes and settings come from the engine; differences are named one by one."""
    kv, cfg = engine()
    want = pool_config_from_vllm(kv, cfg, hash_seed="0")
    assert [g.WhichOneof("spec") for g in want.groups] == ["full", "sliding_window"]
    assert (want.num_blocks, want.hash_block_size, want.max_model_len, want.hash_algo) == (
        32,
        4,
        256,
        "sha256",
    )
    assert pool_config_differences(want, want) == []
    other = pb.PoolConfig()
    other.CopyFrom(want)
    other.num_blocks, other.enable_kv_cache_events, other.log_stats = 31, False, False
    other.groups[1].sliding_window.sliding_window = 16
    other.eagle_group_ids.append(1)  # (vLLM 0.33: which groups drop EAGLE's block)
    diffs = pool_config_differences(want, other)
    assert [d.split(":")[0] for d in diffs] == [
        "num_blocks",
        "group 1",
        "eagle_group_ids",
        "enable_kv_cache_events",
        "log_stats",
    ]
    assert "sliding_window=8" in diffs[1] and "sliding_window=16" in diffs[1]


def test_connect_creates_attaches_and_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """connect creates the pool; a second engine attaches when it shares the pool (not
    exclusive) or once the first is gone; a different engine is refused."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    server = InProcessServer().start()
    try:
        kv, cfg = engine()
        settings = Settings(target=server.address, pool="eng")
        m = connect(settings, kv, cfg)
        # vLLM's requests carry their block hashes (the engine core's block hasher)
        r = Req(
            "a",
            list(range(10)),
            block_hashes=BlockHasher("sha256", 4, none_hash("sha256", "0")).extend(range(10)),
        )
        hit, n = m.get_computed_blocks(r)
        assert (hit.get_block_ids(), n) == (([], []), 0)
        new = m.allocate_slots(r, 10, n, hit)
        assert new is not None and new.get_block_ids() == ([1, 2, 3], [4, 5, 6])
        # 8 tokens cached: two full blocks per group hold hashes, the partial one does not
        table = m.get_blocks("a")  # (as vLLM's scheduler reads a new request's table: ids only)
        assert table.get_block_ids() == ([1, 2, 3], [4, 5, 6])
        assert repr(table) == "KVCacheBlocks(<pending>)"  # answered without a block made
        hashed = [[blk.block_hash is not None for blk in g] for g in m.get_blocks("a").blocks]
        assert hashed == [[True, True, False], [True, True, False]]
        stats = m.make_prefix_cache_stats()
        assert (stats.requests, stats.queries, stats.hits) == (1, 10, 0)
        assert [type(e).__name__ for e in m.take_events()] == ["BlockStored", "BlockStored"]
        m.free(r)
        again = Settings(target=server.address, pool="eng", create_pool=False)
        with pytest.raises(PoolBusyError):
            connect(again, kv, cfg)  # the first engine holds the pool exclusively
        kv2, cfg2 = engine(31, events=False)
        with pytest.raises(PoolMismatchError, match="num_blocks.*enable_kv_cache_events") as err:
            connect(settings, kv2, cfg2, log_stats=False)
        assert len(err.value.differences) == 3
        m.close()
        connect(again, kv, cfg).close()
    finally:
        server.stop()


def test_a_pool_that_cannot_be_predicted_runs_the_waiting_mode(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where prediction is refused (here: the server's engine has other rules, as
    another kvcoord release would), connect warns and runs the waiting mode with a
    shared pool's semantics: every answer is the server's, no allocation is answered
    from the client's own arithmetic (which would be a second copy of the rules), and
    the session does not hold the pool to itself."""
    import kvcoord.service.pool_service as pool_service
    from kvcoord.client import RemoteKVCacheManager

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setattr(pool_service, "rules_fingerprint", lambda: "another-release")
    server = InProcessServer().start()
    try:
        kv, cfg = engine()
        with caplog.at_level("WARNING", logger="kvcoord.client.vllm"):
            m = connect(Settings(target=server.address, pool="fallback"), kv, cfg)
        assert "is not predicted (pool " in caplog.text and "another-release" in caplog.text
        assert "every call is answered by the server" in caplog.text
        remote = m.remote
        assert type(remote) is RemoteKVCacheManager
        assert not remote.exclusive and not remote.keeper.exclusive

        def hashes(tokens: list[int]) -> list[bytes]:
            return BlockHasher("sha256", 4, none_hash("sha256", "0")).extend(tokens)

        r = Req("a", list(range(10)), block_hashes=hashes(list(range(10))))
        hit, n = m.get_computed_blocks(r)
        new = m.allocate_slots(r, 10, n, hit)
        assert new is not None and new.get_block_ids() == ([1, 2, 3], [4, 5, 6])
        for step in range(6):  # decode steps: each answered by a round trip, none promised
            r.all_token_ids.append(100 + step)
            r.block_hashes = hashes(r.all_token_ids)
            before = remote.round_trips
            assert m.allocate_slots(r, 1) is not None
            assert remote.round_trips == before + 1
        # a shared pool's semantics: a second engine that shares the pool attaches beside it
        shared = Settings(target=server.address, pool="fallback", create_pool=False, exclusive=False)
        other = connect(shared, kv, cfg)
        other.close()
        m.close()
    finally:
        server.stop()


def test_settings_from_env() -> None:
    """KVCOORD_TARGET is required; pool, token and create default sensibly."""
    with pytest.raises(ValueError, match="KVCOORD_TARGET"):
        Settings.from_env({})
    s = Settings.from_env({"KVCOORD_TARGET": "h:1", "KVCOORD_CREATE_POOL": "0", "KVCOORD_TOKEN": "t"})
    assert (s.target, s.pool, s.token, s.create_pool, s.cluster) == ("h:1", "vllm", "t", False, "")
    assert Settings.from_env({"KVCOORD_TARGET": "h:1", "KVCOORD_CLUSTER": "prod"}).cluster == "prod"


def test_an_engine_given_a_cluster_name_is_refused_by_a_server_of_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVCOORD_CLUSTER: the engine's every call names a replica of that cluster, so a
    server of no cluster at the target refuses its first call (WRONG_REPLICA), before
    any pool is made or attached there."""
    from kvcoord.client import KVCoordClient, WrongReplicaError

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    server = InProcessServer().start()
    try:
        kv, cfg = engine()
        with pytest.raises(WrongReplicaError):
            connect(Settings(target=server.address, pool="named", cluster="prod"), kv, cfg)
        with KVCoordClient(server.address) as plain:
            assert list(plain.list_pools().pools) == []  # nothing made there
    finally:
        server.stop()


def test_stats_and_events_convert() -> None:
    """Protobuf stats and events become objects with vLLM's fields (int hashes by default)."""
    stats = convert_stats(pb.PrefixCacheStats(requests=2, queries=30, hits=16, preempted_hits=4))
    assert (stats.requests, stats.queries, stats.hits, stats.preempted_hits, stats.reset) == (
        2,
        30,
        16,
        4,
        False,
    )
    h = bytes(range(32))
    events = convert_events(
        [
            pb.KVEvent(block_stored=pb.BlockStored(block_hashes=[h], token_ids=[1, 2], block_size=2)),
            pb.KVEvent(block_removed=pb.BlockRemoved(block_hashes=[h])),
            pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()),
        ]
    )
    stored, removed, cleared = events
    assert stored.block_hashes == [int.from_bytes(h[-8:], "big")] and stored.parent_block_hash is None
    assert (stored.token_ids, stored.block_size, stored.medium, stored.lora_id) == ([1, 2], 2, "GPU", None)
    assert removed.block_hashes == stored.block_hashes
    assert type(cleared).__name__ == "AllBlocksCleared"


def test_a_connectors_finish_path_on_requests_without_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a KV connector, vLLM's scheduler calls remove_skipped_blocks and then
    get_block_ids for every request that finishes, also one aborted while it waited and
    so never allocated (or freed by a preemption). vLLM's manager answers empty tables;
    so does the adapter, without a round trip and without an error. A request that
    holds blocks gets its table, the server's (one round trip carrying the queued calls)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    server = InProcessServer().start()
    try:
        kv, cfg = engine()
        # the waiting mode (its round trips), not the default mirror
        m = connect(Settings(target=server.address, pool="finish", predict=False), kv, cfg)
        hasher_args = ("sha256", 4, none_hash("sha256", "0"))
        waiting = Req("w", list(range(10)), block_hashes=BlockHasher(*hasher_args).extend(range(10)))
        m.get_computed_blocks(waiting)  # looked up, never allocated: the server knows it
        trips = m.remote.round_trips
        m.remove_skipped_blocks("w", 9)
        assert m.get_block_ids("w") == ([], [])
        assert m.get_blocks("w").get_block_ids() == ([], [])
        m.free(waiting)
        m.remove_skipped_blocks("never-seen", 5)
        assert m.get_block_ids("never-seen") == ([], [])
        held = Req("h", list(range(20, 30)), block_hashes=BlockHasher(*hasher_args).extend(range(20, 30)))
        hit, n = m.get_computed_blocks(held)
        new = m.allocate_slots(held, 10, n, hit)
        assert new is not None and new.get_block_ids() == ([1, 2, 3], [4, 5, 6])
        trips = m.remote.round_trips
        m.remove_skipped_blocks("h", 12)  # window 8: the first block leaves it
        assert m.get_block_ids("h") == ([1, 2, 3], [0, 5, 6])
        assert m.remote.round_trips == trips + 1  # the queued skip and the table, in one Step
        m.free(held)
        assert m.get_block_ids("h") == ([], [])
        m.remote.flush()
        assert m.usage == 0.0
        m.close()
    finally:
        server.stop()


def test_a_connectors_finish_path_with_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same finish path on the default (predicted) manager: a request that never
    allocated has empty tables, one that holds blocks its own, all answered by the
    mirror and confirmed by the server's Step."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    server = InProcessServer().start()
    try:
        kv, cfg = engine()
        m = connect(Settings(target=server.address, pool="finish"), kv, cfg)
        assert type(m.remote).__name__ == "PredictingKVCacheManager"
        hasher_args = ("sha256", 4, none_hash("sha256", "0"))
        waiting = Req("w", list(range(10)), block_hashes=BlockHasher(*hasher_args).extend(range(10)))
        m.get_computed_blocks(waiting)
        m.remove_skipped_blocks("w", 9)
        assert m.get_block_ids("w") == ([], [])
        m.free(waiting)
        m.remove_skipped_blocks("never-seen", 5)
        assert m.get_block_ids("never-seen") == ([], [])
        held = Req("h", list(range(20, 30)), block_hashes=BlockHasher(*hasher_args).extend(range(20, 30)))
        hit, n = m.get_computed_blocks(held)
        new = m.allocate_slots(held, 10, n, hit)
        assert new is not None and new.get_block_ids() == ([1, 2, 3], [4, 5, 6])
        m.remove_skipped_blocks("h", 12)  # window 8: the first block leaves it
        assert m.get_block_ids("h") == ([1, 2, 3], [0, 5, 6])
        m.free(held)
        assert m.get_block_ids("h") == ([], [])
        m.remote.flush()  # every call sent and the server's answers compared (raises on a difference)
        assert m.usage == 0.0
        m.close()
    finally:
        server.stop()
