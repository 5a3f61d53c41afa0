"""The rules between the wire and the engine, tested without gRPC: positioned sync,
ownership, Step semantics, sessions, fencing and idempotency."""

from __future__ import annotations

import pytest
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import (
    CacheHit,
    FullAttentionSpec,
    HandedTokenIds,
    KVCacheConfig,
    PrefixCacheStats,
    SlidingWindowSpec,
    TokenIds,
)
from kvcoord.service import operations as op
from kvcoord.service.convert import sync_from_pb
from kvcoord.service.errors import ErrorReason, ServiceError, Status
from kvcoord.service.idempotency import IdempotencyStore, entry_bytes
from kvcoord.service.pool_service import Fence, Limits, PoolService, drain
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock
from kvcoord.v1 import allocator_pb2 as pb

NONE = none_hash("sha256_cbor", "0")


def hashes(tokens: list[int]) -> list[bytes]:
    return BlockHasher("sha256_cbor", 4, NONE).extend(tokens)


def make(clock: ManualClock | None = None, **limits: int) -> PoolService:
    cfg = KVCacheConfig(
        num_blocks=32,
        groups=(FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
        hash_block_size=4,
        enable_kv_cache_events=True,
        max_model_len=256,
    )
    sessions = SessionTable(clock or ManualClock(), 30.0, 60.0)
    return PoolService("p", cfg, ("sha256_cbor", 4, "0"), Fence("inst", 7), Limits(**limits), sessions)


def new(rid: str, tokens: list[int], computed: int | None = None) -> op.RequestSync:
    return op.RequestSync(rid, tokens, hashes(tokens), new_request=True, num_computed_tokens=computed)


def attach(p: PoolService):  # type: ignore[no-untyped-def]
    return p.attach("sha256_cbor", 4, "0", "test", 0)


def test_sync_applies_only_at_its_position() -> None:
    """A sync at the wrong position is SYNC_MISMATCH with the server's position, and
    nothing changes; a duplicate registration is refused the same way."""
    p = make()
    s = attach(p)
    (o,) = p.apply(s, [op.Allocate(new("a", list(range(0, 8))), 8)])
    assert o.error is None
    snap = p.engine.snapshot()
    stale = op.RequestSync("a", [1, 2], [], base_num_tokens=4, base_num_hashes=1)
    (o,) = p.apply(s, [op.Sync(stale)])
    assert o.error is not None and o.error.reason is ErrorReason.SYNC_MISMATCH
    assert o.error.position is not None and (o.error.position.num_tokens, o.error.position.num_hashes) == (
        8,
        2,
    )
    (dup,) = p.apply(s, [op.Allocate(new("a", list(range(0, 8))), 8)])
    assert dup.error is not None and dup.error.reason is ErrorReason.SYNC_MISMATCH
    assert p.engine.snapshot() == snap
    good = op.RequestSync("a", [9], [], base_num_tokens=8, base_num_hashes=2, num_computed_tokens=8)
    (ok,) = p.apply(s, [op.Sync(good)])
    assert ok.error is None and p.engine.requests["a"].num_tokens == 9


def test_unknown_request_is_request_unknown() -> None:
    p = make()
    s = attach(p)
    (o,) = p.apply(s, [op.Sync(op.RequestSync("ghost", [1], []))])
    assert o.error is not None and o.error.reason is ErrorReason.REQUEST_UNKNOWN
    assert o.error.status is Status.NOT_FOUND


def test_step_stops_at_the_first_failure_and_undoes_its_sync() -> None:
    """Operations after a failed one are not applied; the failed one's sync is undone."""
    p = make()
    s = attach(p)
    bad = op.Allocate(new("b", list(range(0, 8))), 8, num_new_computed_tokens=3)  # not block-aligned: refused
    outs = p.apply(s, [op.Allocate(new("a", list(range(0, 4))), 4), bad, op.Free("a")])
    assert outs[0].error is None and outs[1].error is not None and outs[2].aborted_by == 1
    assert set(p.engine.requests) == {"a"} and set(s.owned) == {"a"}


def test_ownership_and_session_end() -> None:
    """Another session cannot touch a request; ending a session frees what it owns."""
    p = make()
    a, b = attach(p), attach(p)
    p.apply(a, [op.Allocate(new("x", list(range(0, 8))), 8)])
    (o,) = p.apply(b, [op.Free("x")])
    assert o.error is not None and o.error.status is Status.DENIED
    free_before = p.engine.num_free_blocks
    assert drain(p.ending_session(a, 0)) == 1
    assert "x" not in p.engine.requests and p.engine.num_free_blocks > free_before
    with pytest.raises(ServiceError) as err:
        p.session(a.session_id, None)
    assert err.value.reason is ErrorReason.SESSION_EXPIRED


def test_fence_mismatch_is_typed() -> None:
    p = make()
    s = attach(p)
    with pytest.raises(ServiceError) as err:
        p.session(s.session_id, Fence("other", 7))
    assert err.value.reason is ErrorReason.INSTANCE_CHANGED
    with pytest.raises(ServiceError) as err:
        p.session(s.session_id, Fence("inst", 8))
    assert err.value.reason is ErrorReason.INCARNATION_CHANGED
    assert p.session(s.session_id, Fence("inst", 7)) is s


def test_stats_and_events_are_per_session() -> None:
    """Each session's make_prefix_cache_stats counts its own lookups; TakeEvents has a
    cursor per session."""
    p = make()
    a, b = attach(p), attach(p)
    p.apply(a, [op.Lookup(new("x", list(range(0, 9))))])
    (sa,) = p.apply(a, [op.MakeStats()])
    (sb,) = p.apply(b, [op.MakeStats()])
    assert isinstance(sa.value, PrefixCacheStats) and sa.value.requests == 1
    assert isinstance(sb.value, PrefixCacheStats) and sb.value.requests == 0
    p.apply(a, [op.Allocate(op.RequestSync("x", base_num_tokens=9, base_num_hashes=2), 9),
                op.CacheBlocks(op.RequestSync("x", base_num_tokens=9, base_num_hashes=2), 9)])  # fmt: skip
    (ea,) = p.apply(a, [op.TakeEvents()])
    (eb,) = p.apply(b, [op.TakeEvents()])
    assert isinstance(ea.value, op.EventsTaken) and isinstance(eb.value, op.EventsTaken)
    assert ea.value.events and ea.value.events == eb.value.events
    (again,) = p.apply(a, [op.TakeEvents()])
    assert isinstance(again.value, op.EventsTaken) and again.value.events == []


def test_grace_period_refuses_sessions() -> None:
    clock = ManualClock()
    p = make(clock)
    p.grace_until = clock() + 10
    with pytest.raises(ServiceError) as err:
        attach(p)
    assert err.value.reason is ErrorReason.GRACE_PERIOD
    clock.advance(10)
    assert attach(p).session_id


def test_max_requests_limit_changes_nothing() -> None:
    p = make(max_requests_per_pool=1)
    s = attach(p)
    p.apply(s, [op.Sync(new("a", list(range(0, 4))))])
    (o,) = p.apply(s, [op.Sync(new("b", list(range(0, 4))))])
    assert o.error is not None and o.error.status is Status.EXHAUSTED
    assert set(p.engine.requests) == {"a"}


# -- idempotency -----------------------------------------------------------------------
def test_keys_are_scoped_to_session_and_rpc_and_bound_to_the_body() -> None:
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.remember("s1", "Step", "k", b"d1", b"answer")
    assert store.lookup("s1", "Step", "k", b"d1") == b"answer"
    assert store.lookup("s2", "Step", "k", b"d1") is None  # another session's key
    for rpc, digest in (("Step", b"d2"), ("Free", b"d1")):
        with pytest.raises(ServiceError) as err:
            store.lookup("s1", rpc, "k", digest)
        assert err.value.reason is ErrorReason.KEY_REUSED
        assert err.value.status is Status.INVALID


def test_answers_live_for_the_window_and_eviction_is_never_a_reapply() -> None:
    """Past the byte budget an answer becomes a tombstone (ANSWER_EVICTED, never
    applied again); past the window everything of it goes."""
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=2 * entry_bytes("s", "old") + 500)
    store.remember("s", "Step", "old", b"d", b"x" * 300)
    clock.advance(1)
    store.remember("s", "Step", "new", b"d", b"y" * 300)
    with pytest.raises(ServiceError) as err:
        store.lookup("s", "Step", "old", b"d")
    assert err.value.reason is ErrorReason.ANSWER_EVICTED
    assert store.lookup("s", "Step", "new", b"d") == b"y" * 300
    clock.advance(59.5)
    assert store.lookup("s", "Step", "old", b"d") is None and len(store) == 1
    clock.advance(1)
    store.expire()
    assert len(store) == 0 and store.bytes == 0


def test_many_answers_in_the_window_are_all_kept() -> None:
    """4,096 newer answers do not push out a retry's answer (the old count limit did)."""
    store = IdempotencyStore(ManualClock(), window=60, max_bytes=64 << 20)
    store.remember("s", "Step", "first", b"d", b"first")
    for i in range(5000):
        store.remember("s", "Step", f"k{i}", b"d", b"z" * 20)
    assert store.lookup("s", "Step", "first", b"d") == b"first"


def test_ending_a_session_drops_its_keys() -> None:
    store = IdempotencyStore(ManualClock(), window=60, max_bytes=1 << 20)
    store.remember("s", "Step", "k", b"d", b"a")
    store.remember("t", "Step", "k", b"d", b"b")
    store.drop_session("s")
    assert store.lookup("s", "Step", "k", b"d") is None and store.lookup("t", "Step", "k", b"d") == b"b"


def test_stale_hit_undoes_the_registration_that_came_with_it() -> None:
    """A new request whose adopted hit went stale is not left registered."""
    from kvcoord.engine import CacheHit

    p = make()
    s = attach(p)
    p.apply(s, [op.Allocate(new("a", list(range(9))), 9), op.Free("a")])
    snap = p.engine.snapshot()
    bogus = CacheHit(((30, 31), (0, 31)), 8)  # blocks never used: not cached for this prefix
    (o,) = p.apply(
        s, [op.Allocate(new("b", list(range(9))), 1, num_new_computed_tokens=8, new_computed_blocks=bogus)]
    )
    assert o.error is None and isinstance(o.value, op.AllocateOutcome) and o.value.stale_hit
    assert "b" not in p.engine.requests and "b" not in s.owned
    assert p.engine.snapshot() == snap


def test_exclusive_session_is_alone() -> None:
    """An exclusive session is refused beside others, and refuses others while it lives."""
    p = make()
    a = attach(p)
    with pytest.raises(ServiceError) as err:
        p.attach("sha256_cbor", 4, "0", "x", 0, exclusive=True)
    assert err.value.status is Status.PRECONDITION
    drain(p.ending_session(a, 0))
    x = p.attach("sha256_cbor", 4, "0", "x", 0, exclusive=True)
    with pytest.raises(ServiceError):
        attach(p)
    drain(p.ending_session(x, 0))
    assert attach(p).session_id


def test_a_broken_promise_is_loud() -> None:
    """An allocation the client answered as successful but the pool refuses is
    PREDICTION_FAILED, never a silent refusal."""
    p = make()
    s = attach(p)
    (o,) = p.apply(s, [op.Allocate(new("big", list(range(200))), 200, must_succeed=True)])
    assert o.error is not None and o.error.reason is ErrorReason.PREDICTION_FAILED
    assert "big" not in p.engine.requests
    (o,) = p.apply(s, [op.Allocate(new("big", list(range(200))), 200)])
    assert isinstance(o.value, op.AllocateOutcome) and o.value.refused


def test_state_rides_with_the_answer() -> None:
    """take_events / make_stats give the session's share once, then nothing."""
    p = make()
    s = attach(p)
    p.apply(s, [op.Lookup(new("x", list(range(9))))])
    stats = p.make_stats(s)
    assert stats is not None and stats.requests == 1
    again = p.make_stats(s)
    assert again is not None and again.requests == 0
    assert p.take_events(s).events == []


def test_gc_freezer_freezes_once_enough_blocks_exist() -> None:
    """Long-lived blocks are moved out of the cyclic GC's reach once enough accumulated."""
    import gc
    from types import SimpleNamespace

    from kvcoord.service.gc_freezer import GcFreezer

    def pool(n: int) -> object:
        return SimpleNamespace(num_materialised_blocks=n)

    freezer = GcFreezer(every_blocks=1000)
    try:
        assert not freezer.maybe_freeze([pool(600)])
        assert freezer.maybe_freeze([pool(600), pool(500)]) and gc.get_freeze_count() > 0
        assert not freezer.maybe_freeze([pool(600), pool(900)])  # 400 new since
        assert not freezer.maybe_freeze([pool(10)])  # a pool went away: count from there
        assert freezer.maybe_freeze([pool(10), pool(1000)])
    finally:
        gc.unfreeze()


def test_admit_equals_lookups_and_allocations_one_by_one() -> None:
    """An Admit gives the same hits, token counts, blocks, refusal point, statistics
    and pool state as get_computed_blocks + allocate_slots called one by one."""
    prompts = [list(range(20)), list(range(12)) + [99] * 9, list(range(40)), list(range(300, 330))]
    one, batch = make(), make()
    s1, s2 = attach(one), attach(batch)
    # warm both pools identically: something cached to hit
    for p in (one, batch):
        s = s1 if p is one else s2
        p.apply(s, [op.Allocate(new("w", list(range(24))), 24), op.Free("w")])
    budget = 70
    expected = []
    for i, tokens in enumerate(prompts):
        if budget <= 0:
            break
        (look,) = one.apply(s1, [op.Lookup(new(f"r{i}", tokens))])
        hit = look.value
        assert isinstance(hit, CacheHit)
        n = min(len(tokens) - hit.num_tokens, budget)
        sync = op.RequestSync(f"r{i}", base_num_tokens=len(tokens), base_num_hashes=len(tokens) // 4)
        (alloc,) = one.apply(s1, [op.Allocate(sync, n, hit.num_tokens, None if hit.is_empty else hit)])
        assert isinstance(alloc.value, op.AllocateOutcome)
        expected.append((hit.block_ids, hit.num_tokens, n, alloc.value.new_block_ids))
        if alloc.value.new_block_ids is None:
            break
        budget -= n
    (got,) = batch.apply(s2, [op.Admit([new(f"r{i}", t) for i, t in enumerate(prompts)], 70)])
    assert isinstance(got.value, op.Admitted)
    assert [
        (o.hit.block_ids, o.hit.num_tokens, o.num_new_tokens, o.new_block_ids) for o in got.value.outcomes
    ] == expected  # type: ignore[union-attr]
    assert expected[-1][3] is None  # the pool ran out: the last one refused, as one by one
    assert batch.engine.snapshot() == one.engine.snapshot()
    assert batch.make_stats(s2) == one.make_stats(s1)
    # a spent budget stops before the next request, which stays untouched
    (spent,) = batch.apply(s2, [op.Admit([new("x", list(range(8))), new("y", list(range(8)))], 3)])
    assert isinstance(spent.value, op.Admitted) and len(spent.value.outcomes) == 1
    assert "x" in batch.engine.requests and "y" not in batch.engine.requests


def test_budget_eviction_does_not_rescan_tombstones() -> None:
    """Over its byte budget the store evicts oldest answers one at a time: many
    tombstones ahead do not make each new answer rescan them (O(1) per answer)."""
    keys = sum(entry_bytes("s", f"k{i}") for i in range(20_000))  # every key counts too
    store = IdempotencyStore(ManualClock(), window=600, max_bytes=keys + 50_000)
    for i in range(20_000):
        store.remember("s", "Step", f"k{i}", b"d", b"x" * 100)
    assert store.bytes <= keys + 50_000 and len(store._answered) <= 500  # 500 answers of 100 bytes kept
    assert store.lookup("s", "Step", "k19999", b"d") == b"x" * 100
    with pytest.raises(ServiceError):
        store.lookup("s", "Step", "k0", b"d")  # a tombstone: answered once, never again


def test_a_promised_allocation_whose_hit_went_stale_is_loud() -> None:
    """A hit that went stale under an allocation the client already answered is
    PREDICTION_FAILED (never a quiet stale_hit the client cannot take back)."""
    p = make()
    s = attach(p)
    bogus = CacheHit(((30, 31), (0, 31)), 8)
    (o,) = p.apply(s, [op.Allocate(new("b", list(range(9))), 1, 8, bogus, must_succeed=True)])
    assert o.error is not None and o.error.reason is ErrorReason.PREDICTION_FAILED
    assert "b" not in p.engine.requests


def test_wire_tokens_reach_the_engine_as_checked_token_ids() -> None:
    """Tokens read from the wire (uint32: never negative) reach the engine as TokenIds,
    which it takes without walking them again."""
    sync = sync_from_pb(pb.RequestSync(request_id="r", append_token_ids=[3, 0, 7]))
    assert type(sync.append_token_ids) is TokenIds
    assert sync.append_token_ids == [3, 0, 7]
    # a new request's tokens are read for its sync alone: handed over, the engine keeps
    # that very list as the request's tokens (no copy of a long prompt)
    sync = sync_from_pb(pb.RequestSync(request_id="r", append_token_ids=[3, 0, 7], new_request=True))
    assert type(sync.append_token_ids) is HandedTokenIds
    p = make()
    s = attach(p)
    (o,) = p.apply(s, [op.Allocate(sync, 3)])
    assert o.error is None and p.engine.requests["r"].all_token_ids is sync.append_token_ids


def test_a_table_answered_by_the_client_is_checked() -> None:
    """GetBlockIds with the table the client already answered with: the same table
    passes (and is returned), another is PREDICTION_FAILED and changes nothing; without
    one it is a plain read."""
    p = make()
    s = attach(p)
    (o,) = p.apply(s, [op.Allocate(new("a", list(range(0, 10))), 10)])
    assert o.error is None
    table = p.engine.get_block_ids("a")
    (plain, same) = p.apply(s, [op.GetBlockIds("a"), op.GetBlockIds("a", table)])
    assert plain.error is None and same.error is None and plain.value == same.value == table
    wrong = (table[0], (0,) + table[1][1:])
    snap = p.engine.snapshot()
    (o,) = p.apply(s, [op.GetBlockIds("a", wrong)])
    assert o.error is not None and o.error.reason is ErrorReason.PREDICTION_FAILED
    assert p.engine.snapshot() == snap


def test_a_free_sent_again_is_idempotent_only_when_asked() -> None:
    """Free of an unknown request: REQUEST_UNKNOWN; with if_held (a free sent again after
    a Step whose outcome the client could not learn) nothing to do. A request of
    another session is refused by a plain free, and left alone by one with if_held
    ("free it if I still hold it": that session's request is not this one's)."""
    p = make()
    s, t = attach(p), attach(p)
    (o,) = p.apply(s, [op.Allocate(new("a", list(range(8))), 8)])
    assert o.error is None
    (gone,) = p.apply(s, [op.Free("ghost")])
    assert gone.error is not None and gone.error.reason is ErrorReason.REQUEST_UNKNOWN
    (again,) = p.apply(s, [op.Free("ghost", if_held=True)])
    assert again.error is None
    (refused,) = p.apply(t, [op.Free("a")])
    assert refused.error is not None and refused.error.status is Status.DENIED
    (other,) = p.apply(t, [op.Free("a", if_held=True)])
    assert other.error is None and "a" in p.engine.requests
    (mine,) = p.apply(s, [op.Free("a", if_held=True)])
    assert mine.error is None and "a" not in p.engine.requests


def test_keys_past_any_retry_make_room_for_new_ones() -> None:
    """When the keys alone fill the budget, those older than half the window (no
    client retries that late) go, oldest first, so a steady load never meets a full
    store; keys of the last half window are kept, and only when they alone fill it is
    a new key refused. (Before, a steady 388 keyed Steps a second filled the default
    64 MiB within the 300 s window and refused every worker's Step.)"""
    clock = ManualClock()
    per_key = entry_bytes("s", "k0000")
    store = IdempotencyStore(clock, window=60, max_bytes=10 * per_key)
    for i in range(10):  # one key a second: the budget holds exactly these ten
        assert store.lookup("s", "Step", f"k{i:04}", b"d") is None
        store.remember("s", "Step", f"k{i:04}", b"d", b"a")
        clock.advance(1)
    clock.advance(24.5)  # k0000..k0004 are now older than 30 s (half the window), k0005 not
    for i in range(10, 15):
        assert store.lookup("s", "Step", f"k{i:04}", b"d") is None  # room made
        store.remember("s", "Step", f"k{i:04}", b"d", b"a")
    assert {e[1] for e in store.export()} == {f"k{i:04}" for i in range(5, 15)}
    assert store.entry_bytes <= store.max_bytes
    with pytest.raises(ServiceError) as err:  # k0005 is 29.5 s old: a client may still retry it
        store.lookup("s", "Step", "k0015", b"d")
    assert err.value.status is Status.EXHAUSTED
    with pytest.raises(ServiceError) as err:  # a kept key is still a tombstone
        store.lookup("s", "Step", "k0006", b"d")
    assert err.value.reason is ErrorReason.ANSWER_EVICTED
