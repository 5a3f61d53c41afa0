"""Cache namespaces in the engine: isolation by key, vLLM's keys and events untouched."""

from __future__ import annotations

import pickle

from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import BlockRemoved, BlockStored, FullAttentionSpec, KVCacheConfig, KVCachePool
from kvcoord.engine.invariants import check_pool

NONE = none_hash("sha256_cbor", "0")


def _pool(num_blocks: int = 16) -> KVCachePool:
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        groups=(FullAttentionSpec(4),),
        hash_block_size=4,
        enable_kv_cache_events=True,
        hash_length=32,
    )
    return KVCachePool(cfg)


def _cached(pool: KVCachePool, rid: str, tokens: list[int], namespace: str) -> list[bytes]:
    hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)
    pool.add_request(rid, tokens, hashes, cache_namespace=namespace)
    assert pool.allocate_slots(rid, len(tokens)) is not None
    return hashes


def test_namespaces_never_hit_each_other() -> None:
    """The same hashes cached in namespace a hit only requests of namespace a, through
    get_computed_blocks and find_longest_cache_hit; the default namespace is vLLM's."""
    pool = _pool()
    tokens = list(range(12))
    hashes = _cached(pool, "a1", tokens, "a")
    assert pool.find_longest_cache_hit(hashes, 13, "a").num_tokens == 12
    assert pool.find_longest_cache_hit(hashes, 13, "b").num_tokens == 0
    assert pool.find_longest_cache_hit(hashes, 13).num_tokens == 0
    pool.add_request("b1", tokens + [0], hashes, cache_namespace="b")
    assert pool.get_computed_blocks("b1").num_tokens == 0
    pool.add_request("a2", tokens + [0], hashes, cache_namespace="a")
    assert pool.get_computed_blocks("a2").num_tokens == 12
    assert check_pool(pool).ok


def test_events_carry_client_hashes_and_default_keys_are_vllms() -> None:
    """BlockStored and BlockRemoved name the client's hashes for namespaced blocks; a
    request without a namespace is cached under its hash itself (vLLM's key)."""
    pool = _pool(num_blocks=4)  # 3 usable blocks: the second request evicts the first's
    hashes = _cached(pool, "a1", list(range(12)), "a")
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert list(stored[0].block_hashes) == hashes
    pool.free("a1")
    plain = _cached(pool, "p1", list(range(100, 112)), "")
    events = pool.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(hashes)
    # each event names its namespace (the server gives a session only its own's)
    a = pool.cache_namespace_prefix("a")
    assert {e.cache_prefix for e in events if isinstance(e, BlockRemoved)} == {a}
    assert [e.cache_prefix for e in events if isinstance(e, BlockStored)] == [b""]
    assert stored[0].cache_prefix == a
    keys = {k[:-4] for k, _ in pool.block_pool.cached_block_hash_to_block.items()}
    assert keys == set(plain)
    assert check_pool(pool).ok


def test_namespace_prefixes_follow_first_use() -> None:
    """Prefixes are 4 bytes assigned in order of first use, never 0, "" has none."""
    pool = _pool()
    assert pool.cache_namespace_prefix("") == b""
    assert pool.cache_namespace_prefix("x") == (1).to_bytes(4, "big")
    assert pool.cache_namespace_prefix("y") == (2).to_bytes(4, "big")
    assert pool.cache_namespace_prefix("x") == (1).to_bytes(4, "big")


def test_events_from_an_older_snapshot_load_in_the_default_namespace() -> None:
    """A snapshot written before events named their namespace unpickles (the missing
    field gets its default) instead of failing when the event is read."""
    event = object.__new__(BlockRemoved)
    event.__setstate__([(b"h",), "GPU"])
    assert event == BlockRemoved((b"h",))
    stored = BlockStored((b"h",), None, (1, 2), 2, None, None, cache_prefix=b"\0\0\0\1")
    assert pickle.loads(pickle.dumps(stored)) == stored
