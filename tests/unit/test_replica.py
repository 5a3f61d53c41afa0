"""The client's pool replica against the engine: the same calls give the same blocks,
hits, free counts, events and statistics, from a fresh pool and from the state the
server hands an exclusive session (``KVCachePool.replica_state``), without gRPC."""

from __future__ import annotations

import random

import pytest
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.replica import PoolReplica, ReplicaRefusal
from kvcoord.engine import CacheHit, FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import event_to_pb, write_pool_state

NONE = none_hash("sha256_cbor", "0")
BS = 4


class _Req:
    def __init__(self, rid: str, tokens: list[int], max_out: int) -> None:
        self.rid = rid
        self.tokens = tokens
        self.hasher = BlockHasher("sha256_cbor", BS, NONE)
        self.hashes = self.hasher.extend(tokens)
        self.computed = 0
        self.max_out = max_out
        self.prompt = len(tokens)
        self.preemptions = 0
        self.synced = (0, 0)  # tokens and hashes the engine holds

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.hashes.extend(self.hasher.extend([token]))


def _config(num_blocks: int, caching: bool, events: bool) -> tuple[KVCacheConfig, pb.PoolConfig]:
    engine = KVCacheConfig(
        num_blocks=num_blocks, groups=(FullAttentionSpec(BS),), hash_block_size=BS, max_model_len=512,
        enable_caching=caching, enable_kv_cache_events=events,
    )  # fmt: skip
    wire = pb.PoolConfig(
        num_blocks=num_blocks, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))],
        hash_block_size=BS, max_model_len=512, enable_caching=caching, enable_kv_cache_events=events,
    )  # fmt: skip
    return engine, wire


def _state(pool: KVCachePool) -> pb.PoolState:
    response = pb.AttachResponse()
    write_pool_state(response, pool.replica_state())
    assert response.HasField("pool_state"), response.pool_state_unavailable
    return response.pool_state


class _Twin:
    """The engine and a replica driven by the same scheduler-shaped calls."""

    def __init__(self, pool: KVCachePool, replica: PoolReplica) -> None:
        self.pool, self.replica = pool, replica
        self.registered: set[str] = set()
        self.calls = 0

    def _sync(self, r: _Req) -> None:
        if r.rid not in self.registered:
            self.pool.add_request(r.rid, r.tokens, r.hashes, num_preemptions=r.preemptions)
            self.registered.add(r.rid)
        else:
            t, h = r.synced
            self.pool.update_request(r.rid, append_token_ids=r.tokens[t:], append_block_hashes=r.hashes[h:])
        self.pool.update_request(r.rid, num_computed_tokens=r.computed)
        r.synced = (len(r.tokens), len(r.hashes))

    def lookup(self, r: _Req) -> list[int]:
        self._sync(r)
        hit = self.pool.get_computed_blocks(r.rid)
        if not self.replica.enable_caching:  # the manager looks nothing up: an empty hit
            assert hit.is_empty
            return []
        got = self.replica.lookup(r.hashes, len(r.tokens), r.preemptions > 0)
        assert got == list(hit.block_ids[0])
        return got

    def allocate(self, r: _Req, n: int, hit: list[int], lookahead: int = 0) -> list[int] | None:
        self._sync(r)
        hit_tokens = len(hit) * BS
        engine_hit = CacheHit((tuple(hit),), hit_tokens) if hit else None
        want = self.pool.allocate_slots(r.rid, n, hit_tokens, engine_hit, lookahead)
        assert self.replica.check(r.rid, r.computed, hit_tokens, n, hit, r.hashes)
        self.calls += 1
        if hit or self.calls % 2:
            got = self.replica.allocate(r.rid, r.computed, hit_tokens, n, hit, lookahead, r.tokens, r.hashes)
        else:  # the manager's path for an allocation without a hit
            got = self.replica.grow(r.rid, r.computed, n, lookahead, r.tokens, r.hashes)
        assert got == (None if want is None else list(want[0]))
        self.same()
        return got

    def free(self, r: _Req) -> None:
        self.pool.free(r.rid)
        self.registered.discard(r.rid)
        self.replica.free(r.rid)
        self.same()

    def same(self) -> None:
        assert self.replica.num_free_blocks == self.pool.num_free_blocks
        assert self.replica.usage == self.pool.usage

    def events_and_stats(self) -> None:
        assert [event_to_pb(e) for e in self.pool.take_events()] == self.replica.events
        self.replica.events = []
        want = self.pool.make_prefix_cache_stats()
        got = self.replica.take_stats()
        if want is not None:
            assert (got.requests, got.queries, got.hits, got.preempted_requests, got.preempted_queries,
                    got.preempted_hits) == (want.requests, want.queries, want.hits, want.preempted_requests,
                                            want.preempted_queries, want.preempted_hits)  # fmt: skip


def _workload(twin: _Twin, rnd: random.Random, steps: int, prefix: int) -> list[_Req]:
    """A scheduler loop: running requests first (preempting from the end when refused),
    then waiting ones with a lookup; returns the requests still running."""
    prefixes = [[rnd.randrange(50) for _ in range(rnd.choice((4, 8, 12)))] for _ in range(3)]
    counter = 0

    def new() -> _Req:
        nonlocal counter
        counter += 1
        body = [rnd.randrange(50) for _ in range(rnd.randint(1, 30))]
        tokens = (rnd.choice(prefixes) if rnd.random() < 0.6 else []) + body
        return _Req(f"p{prefix}-r{counter}", tokens, rnd.randint(1, 12))

    running: list[_Req] = []
    waiting = [new() for _ in range(6)]
    for _ in range(steps):
        budget, scheduled, preempted = 48, [], False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(len(r.tokens) - r.computed, budget)
            new_ids = twin.allocate(r, n, [], lookahead=rnd.choice((0, 0, 2)))
            if new_ids is None:
                victim = running.pop()
                twin.free(victim)
                victim.computed, victim.preemptions = 0, victim.preemptions + 1
                waiting.insert(0, victim)
                preempted = True
                if victim is r:
                    continue
                continue
            scheduled.append((r, n))
            budget -= n
            i += 1
        while waiting and budget > 0 and not preempted:
            r = waiting[0]
            hit = twin.lookup(r)
            n = min(len(r.tokens) - len(hit) * BS, budget)
            if twin.allocate(r, n, hit) is None:
                break
            waiting.pop(0)
            r.computed = len(hit) * BS
            running.append(r)
            scheduled.append((r, n))
            budget -= n
        for r, n in scheduled:
            r.computed += n
            if r.computed >= len(r.tokens):
                r.append(rnd.randrange(50))
        for r in [r for r in running if len(r.tokens) - r.prompt >= r.max_out]:
            running.remove(r)
            twin.free(r)
            if rnd.random() < 0.8:
                waiting.append(new())
        twin.events_and_stats()
    return running


@pytest.mark.parametrize("caching,events", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("seed", range(8))
def test_the_replica_gives_the_engines_answers(seed: int, caching: bool, events: bool) -> None:
    """From a fresh pool, then from the state a second exclusive session gets (every
    request freed, the free queue reordered, blocks cached, some hashes cached in
    several blocks), every lookup, allocation, refusal, free count, event and statistic
    of a scheduler loop is the engine's."""
    rnd = random.Random(seed)
    engine_cfg, wire_cfg = _config(rnd.choice((24, 40, 64)), caching, events)
    pool = KVCachePool(engine_cfg)
    twin = _Twin(pool, PoolReplica(wire_cfg, _state(pool)))
    for r in _workload(twin, rnd, 60, 0):
        twin.free(r)
    twin.events_and_stats()
    for r in list(twin.registered):  # looked up, never admitted: registered, holding nothing
        pool.free(r)
    twin.registered.clear()
    state = _state(pool)
    if caching and seed == 0:
        assert state.cached_block_ids and state.used_free_blocks  # the second half starts from a used pool
    second = _Twin(pool, PoolReplica(wire_cfg, state))
    _workload(second, rnd, 60, 1)


def test_a_hash_cached_in_several_blocks_is_found_in_the_earliest_left() -> None:
    """Three requests with the same prompt each cache it (none looked it up): lookups
    find the first request's blocks; once one of them is reused, the next cached one
    in order (the second request's, not the third's)."""
    engine_cfg, wire_cfg = _config(8, True, True)
    pool = KVCachePool(engine_cfg)
    twin = _Twin(pool, PoolReplica(wire_cfg, _state(pool)))
    a, b, e = (_Req(rid, list(range(8)), 1) for rid in "abe")
    assert [twin.allocate(r, 8, []) for r in (a, b, e)] == [[1, 2], [3, 4], [5, 6]]
    for r in (a, b, e):
        twin.free(r)
    h0, h1 = a.hashes
    assert state_pairs(_state(pool)) == [(h0, 1), (h0, 3), (h0, 5), (h1, 2), (h1, 4), (h1, 6)]
    c = _Req("c", list(range(8)) + [99], 1)
    assert twin.lookup(c) == [1, 2]
    d = _Req("d", list(range(100, 108)), 1)
    assert twin.allocate(d, 8, []) == [7, 2]  # the never-used block, then a's last block
    assert twin.lookup(c) == [1, 4]
    twin.events_and_stats()


def state_pairs(state: pb.PoolState) -> list[tuple[bytes, int]]:
    return list(zip(state.cached_block_hashes, state.cached_block_ids, strict=True))


def test_invalid_allocations_are_refused_before_anything_changes() -> None:
    """What the server would refuse as invalid raises ReplicaRefusal; a hit that went
    stale is reported as such (the manager answers it as vLLM's stale refusal)."""
    engine_cfg, wire_cfg = _config(16, True, False)
    pool = KVCachePool(engine_cfg)
    replica = PoolReplica(wire_cfg, _state(pool))
    twin = _Twin(pool, replica)
    a = _Req("a", list(range(9)), 1)
    twin.allocate(a, 9, [])
    with pytest.raises(ReplicaRefusal, match="max_model_len"):
        replica.check("a", 9, 0, 600, [], a.hashes)
    with pytest.raises(ReplicaRefusal, match="num_new_tokens"):
        replica.check("a", 9, 0, 0, [], a.hashes)
    with pytest.raises(ReplicaRefusal, match="already holds blocks"):
        replica.check("a", 9, 4, 1, [1], a.hashes)
    b = _Req("b", list(range(9)) + [7], 1)
    hit = twin.lookup(b)
    assert hit == [1, 2]
    assert replica.check("b", 0, 8, 2, hit, b.hashes)
    assert not replica.check("b", 0, 8, 2, [2, 1], b.hashes)  # not cached under b's hashes there
    free = replica.num_free_blocks
    assert replica.tables.get("b") is None and replica.num_free_blocks == free


def test_a_pool_a_replica_cannot_follow_says_why() -> None:
    """No state for a pool holding requests, caching under a namespace, or another layout."""
    pool = KVCachePool(
        KVCacheConfig(num_blocks=16, groups=(FullAttentionSpec(BS),), hash_block_size=BS, hash_length=32)
    )
    pool.add_request("a", [1, 2, 3], [])
    assert pool.replica_state() == "the pool holds requests"
    pool.free("a")
    pool.cache_namespace_prefix("tenant-b")
    assert pool.replica_state() == "the pool caches under tenants' namespaces"
    hybrid = KVCachePool(
        KVCacheConfig(
            num_blocks=16, groups=(FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)), hash_block_size=BS
        )
    )
    assert hybrid.replica_state() == "the pool is not one group of full attention without a sink"


def test_evictions_resets_caching_and_common_prefixes_follow_the_engine() -> None:
    """evict (in the caller's order, held or free blocks), reset (refused while a block
    is held), cache (a block made full by a later call) and the common prefix count
    (the empty table vLLM registers counting as a holder) give the engine's answers,
    events and statistics."""
    engine_cfg, wire_cfg = _config(16, True, True)
    pool = KVCachePool(engine_cfg)
    twin = _Twin(pool, PoolReplica(wire_cfg, _state(pool)))
    a, b = _Req("a", list(range(10)), 1), _Req("b", list(range(10)) + [5, 5], 1)
    twin.allocate(a, 10, [])
    hit = twin.lookup(b)
    twin.allocate(b, 12 - len(hit) * BS, hit)
    b.computed = 12
    for r in (a, b):
        assert pool.get_num_common_prefix_blocks(r.rid) == (twin.replica.common_prefix(r.rid),)
    assert pool.get_num_common_prefix_blocks("a") == (2,)
    pool.add_request("c", [1, 2, 3], [])  # registered, no table: a holder once asked
    assert pool.get_num_common_prefix_blocks("c") == (twin.replica.common_prefix("c"),) == (0,)
    assert pool.get_num_common_prefix_blocks("a") == (twin.replica.common_prefix("a"),) == (0,)
    pool.free("c")
    twin.replica.free("c")
    b.append(9)
    b.append(9)
    b.append(9)
    b.append(9)  # 16 tokens: b's last block is full once computed
    twin._sync(b)
    pool.allocate_slots("b", 4)
    twin.replica.grow("b", 12, 4, 0, b.tokens, b.hashes)
    pool.cache_blocks("b", 16)  # cached already by the allocation: nothing new
    assert not twin.replica.caches("b", 16)
    twin.events_and_stats()
    e = _Req("e", list(range(100, 110)), 1)
    twin.allocate(e, 14, [])  # slots past its tokens (an async step's placeholders): 2 blocks cached
    for t in range(6):
        e.append(200 + t)
    twin._sync(e)
    assert twin.replica.caches("e", 16)
    pool.cache_blocks("e", 16)  # the step's tokens arrived: the third block is full
    twin.replica.cache("e", 16, e.tokens, e.hashes)
    twin.events_and_stats()
    twin.free(e)
    pool.evict_blocks([3, 1, 7])
    twin.replica.evict([3, 1, 7])
    twin.events_and_stats()
    assert pool.reset_prefix_cache() is False and twin.replica.reset() is False
    twin.free(a)
    twin.free(b)
    assert pool.reset_prefix_cache() is True and twin.replica.reset() is True
    twin.events_and_stats()
    assert twin.lookup(_Req("d", list(range(10)), 1)) == []


def test_without_prefix_caching_no_block_is_a_common_prefix() -> None:
    """vLLM's coordinator without prefix caching answers 0 common prefix blocks (shared
    blocks cannot exist); so does the replica, where a lone request's whole table
    would otherwise count."""
    engine_cfg, wire_cfg = _config(16, False, False)
    pool = KVCachePool(engine_cfg)
    twin = _Twin(pool, PoolReplica(wire_cfg, _state(pool)))
    twin.allocate(_Req("a", list(range(10)), 1), 10, [])
    assert pool.get_num_common_prefix_blocks("a") == (twin.replica.common_prefix("a"),) == (0,)
