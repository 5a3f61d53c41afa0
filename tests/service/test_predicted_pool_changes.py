"""A predicted session whose pool changes under it (HUNTPRED2): the pool created again
with other rules is never mirrored with the old ones, and an operator's reset of the
pool's prefix cache is refused while the session predicts it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kvcoord.client import (
    KVCoordClient,
    PredictingKVCacheManager,
    RemoteKVCacheManager,
    RequestsLostError,
    RetryPolicy,
    UnavailableError,
)
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher
from kvcoord.client.predicting import NOT_TAKEN
from kvcoord.client.predicting_losses import PoolChangedError
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from support import NONE, POOL_TOML, admit_prompt, hashed_req, lapse_predicted_session


def _sliding(window: int) -> pb.PoolConfig:
    """One sliding-window group: the window is a rule, not a count."""
    spec = pb.KVCacheGroupSpec(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=window))
    return pb.PoolConfig(num_blocks=32, groups=[spec], hash_block_size=4, enable_caching=True,
                         hash_algo="sha256_cbor", hash_seed="0", enable_kv_cache_events=True)  # fmt: skip


def test_a_pool_created_again_with_other_rules_is_never_mirrored_with_the_old(client: KVCoordClient) -> None:
    """The pool is deleted and created again with another sliding window (the same
    block and group counts) under a predicted session. The session's next Step fails
    and the manager attaches again: the new pool is neither mirrored with the old
    window (old code: its mirror was the old configuration's engine loaded with the
    new pool's state, answering by the old rules until a difference was seen) nor
    used: PoolChangedError naming the field, no session left holding the pool, and
    every later call refused the same way without attaching again."""
    client.create_pool("sw", _sliding(8))
    m = PredictingKVCacheManager(client, "sw", hash_seed="0", renew=False)
    admit_prompt(m, hashed_req("a", list(range(9))))
    m.flush()
    client.delete_pool("sw", force=True)  # (under the session: refused unless forced)
    client.create_pool("sw", _sliding(16))
    admit_prompt(m, hashed_req("b", list(range(40, 61))))  # answered from the mirror; its Step fails
    with pytest.raises(PoolChangedError) as info:
        m.flush()
    assert info.value.changes == ["groups"]
    assert not client.list_sessions("sw").sessions
    attaches = client.get_stats("sw").num_sessions
    with pytest.raises(PoolChangedError):
        admit_prompt(m, hashed_req("c", list(range(9))))
    assert client.get_stats("sw").num_sessions == attaches == 0
    assert not isinstance(info.value, RequestsLostError)


def test_an_operators_reset_of_a_predicted_pool_is_refused_naming_the_session(client: KVCoordClient) -> None:
    """ResetPrefixCache (the RPC, not the session's own Step operation) on a pool whose
    exclusive session answers from its mirror would void every hit the mirror still
    finds, unseen until a Step's answer differs (old code: reset, the mirror's hit on
    the reset blocks refused a backlog late and every request lost). It is refused
    (PoolBusyError, POOL_EXCLUSIVE, naming the session's client) and nothing changed:
    the mirror's hit stands and the session goes on without a loss. The session's own
    reset (its id named) is still its own to make."""
    from kvcoord.client import PoolBusyError

    client.create_pool("full", _sliding(64))
    m = PredictingKVCacheManager(client, "full", hash_seed="0", renew=False, client_name="engine-7")
    a = hashed_req("a", list(range(9)))
    admit_prompt(m, a)
    m.free(a)  # its two full blocks stay cached, free
    m.flush()
    with pytest.raises(PoolBusyError) as info:
        client.reset_prefix_cache("full")
    assert info.value.reason == "POOL_EXCLUSIVE"
    assert "'engine-7'" in info.value.message
    b = hashed_req("b", list(range(9)))
    hit, hit_tokens = m.get_computed_blocks(b)
    assert hit_tokens == 8
    admit_prompt(m, b)
    m.flush()  # the server's hit is the mirror's: no loss
    assert m.lost_requests == 0
    m.free(b)
    m.flush()
    assert client.reset_prefix_cache("full", m.session_id, m.keeper.fence).result  # the session's own
    m.close()


def test_a_predicted_step_keeps_the_servers_max_ops_per_step(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A server whose max_ops_per_step is low: a scheduler step of more calls than that
    is sent as Steps of at most that many operations, answered as one (old code: split
    by bytes only, the Step was refused RESOURCE_EXHAUSTED and every request lost, and
    again at every step as large: the engine never got past it)."""
    server = make_server(POOL_TOML, limits=Limits(max_ops_per_step=4))
    with KVCoordClient(server.address, timeout=10) as c:
        m = PredictingKVCacheManager(c, "p", hash_seed="0", renew=False)
        for k in range(3):
            for i in range(6):
                admit_prompt(m, hashed_req(f"r{k}-{i}", list(range(100 * i, 100 * i + 5 + k))))
            m.take_events()
            m.flush()
        assert m.lost_requests == 0
        assert len(c.inspect_pool("p", all_requests=True).requests) == 18
        m.close()


def test_a_predicted_decode_run_keeps_the_servers_max_ops_per_step(
    make_server: Callable[..., InProcessServer],
) -> None:
    """More running requests than the server's max_ops_per_step decode in one scheduler
    step: their allocations are gathered as runs (one DecodeOp or AllocateRunOp each) of
    at most that many entries (old code: one run of every entry, refused INVALID_ARGUMENT
    "ops[0].decode.request_ids is 6 items long", every request lost at every step)."""
    server = make_server(POOL_TOML, limits=Limits(max_ops_per_step=4))
    with KVCoordClient(server.address, timeout=10) as c:
        m = PredictingKVCacheManager(c, "p", hash_seed="0", renew=False)
        running = [hashed_req(f"r{i}", list(range(100 * i, 100 * i + 5))) for i in range(6)]
        for r in running:
            admit_prompt(m, r)
        m.take_events()
        for step in range(6):  # inside their blocks and across a block boundary
            for r in running:
                r.all_token_ids.append(7 + step)
                r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(list(r.all_token_ids))
                got = m.allocate_running(r, 1)
                assert got is not None and got is not NOT_TAKEN
                r.num_computed_tokens += 1
            m.take_events()
        m.flush()
        assert m.lost_requests == 0
        tables = {s.request_id: s for s in c.inspect_pool("p", all_requests=True).requests}
        assert sorted(tables) == [r.request_id for r in running]
        m.close()


def test_an_attach_whose_every_answer_was_lost_is_sent_again_with_its_key(
    make_server: Callable[..., InProcessServer], clock: ManualClock
) -> None:
    """A lost session's Attach whose every answer is lost (its retries spent): the server
    made an exclusive session nobody holds. The manager's next attempt sends the Attach
    again with the same attach_key and gets that session (old code: a new key, refused
    PoolBusyError "has an exclusive session" by the orphan until its lease ran out); the
    pool has that one session, and the Attach after it uses a new key."""
    server = make_server("")
    lose = FaultInjector(0, drop=1.0, methods=("Attach",))
    lose.enabled = False
    retry = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)
    with KVCoordClient(server.address, timeout=10, retry=retry, interceptors=[lose]) as c:
        m, _ = lapse_predicted_session(c, server, clock)
        lose.enabled = True
        with pytest.raises(UnavailableError):
            m.flush()  # the Step failed (session expired); attaching again lost every answer
        assert lose.counts["dropped"] == 3
        (orphan,) = c.list_sessions("p").sessions
        lose.enabled = False
        with pytest.raises(RequestsLostError) as info:
            m.flush()
        assert sorted(info.value.request_ids) == ["a", "b"]
        assert m.keeper.session_id == orphan.session_id
        assert [s.session_id for s in c.list_sessions("p").sessions] == [orphan.session_id]
        admit_prompt(m, hashed_req("c", list(range(9))))
        m.flush()
        assert m.lost_requests == 2
        m.close()


def test_a_waiting_session_never_uses_a_pool_created_again_with_other_rules(client: KVCoordClient) -> None:
    """The waiting mode (every answer the server's) meets the same: the pool created
    again with another sliding window would free blocks by a window the engine's
    attention does not use. The Attach after the loss ends its session and raises
    PoolChangedError, at that call and every later one (old code: attached and went on
    by the new pool's rules)."""
    client.create_pool("sw", _sliding(8))
    m = RemoteKVCacheManager(client, "sw", hash_seed="0", renew=False, exclusive=True)
    admit_prompt(m, hashed_req("a", list(range(9))))
    client.delete_pool("sw", force=True)  # (under the session: refused unless forced)
    client.create_pool("sw", _sliding(16))
    with pytest.raises(RequestsLostError):
        admit_prompt(m, hashed_req("b", list(range(40, 61))))  # the pool the session was in is gone
    for rid in ("c", "d"):
        with pytest.raises(PoolChangedError) as info:
            admit_prompt(m, hashed_req(rid, list(range(9))))
        assert info.value.changes == ["groups"]
    assert not client.list_sessions("sw").sessions


def test_deleting_a_predicted_pool_is_refused_unless_forced_or_by_its_session(client: KVCoordClient) -> None:
    """DeletePool of a pool whose exclusive session answers from its mirror would void
    the block ids its worker runs on, unseen until a Step fails a backlog later (old
    code: deleted at once). It is refused (PoolBusyError, POOL_EXCLUSIVE, naming the
    session's client), nothing deleted, and the session goes on without a loss; a call
    naming an unknown session is NOT_FOUND. The session itself may delete its pool, and
    an operator who means it forces the call: the engine is then told loudly (its
    next Step fails, the pool is not found), never given the voided ids as its own."""
    from kvcoord.client import NotFoundError, PoolBusyError

    client.create_pool("full", _sliding(64))
    m = PredictingKVCacheManager(client, "full", hash_seed="0", renew=False, client_name="engine-7")
    admit_prompt(m, hashed_req("a", list(range(9))))
    m.flush()
    with pytest.raises(PoolBusyError) as info:
        client.delete_pool("full")
    assert info.value.reason == "POOL_EXCLUSIVE"
    assert "'engine-7'" in info.value.message
    with pytest.raises(NotFoundError):
        client.delete_pool("full", session_id="0" * 32)
    assert "full" in {p.name for p in client.list_pools().pools}
    admit_prompt(m, hashed_req("b", list(range(40, 49))))
    m.flush()
    assert m.lost_requests == 0
    assert len(client.inspect_pool("full", all_requests=True).requests) == 2

    client.delete_pool("full", force=True)  # the operator means it
    assert "full" not in {p.name for p in client.list_pools().pools}
    admit_prompt(m, hashed_req("c", list(range(9))))  # answered from the mirror; its Step fails
    with pytest.raises(NotFoundError):  # ... and attaching again finds no pool: loud, typed
        m.flush()

    client.create_pool("own", _sliding(64))
    own = PredictingKVCacheManager(client, "own", hash_seed="0", renew=False)
    admit_prompt(own, hashed_req("a", list(range(9))))
    own.flush()
    client.delete_pool("own", session_id=own.session_id)  # the session's own deletion
    assert "own" not in {p.name for p in client.list_pools().pools}


@pytest.mark.parametrize("kind", ["waiting", "predicted"])
def test_a_pool_written_otherwise_with_the_same_rules_is_the_same_pool(
    client: KVCoordClient, kind: str
) -> None:
    """The pool is created again under a session with the same rules written otherwise:
    the defaults filled in explicitly (log_stats unset -> true, profile "" ->
    "vllm-0.16", as a server or a declaration of another version may write them). The
    session's requests are lost (the pool it was in is gone) and the manager attaches
    again and goes on (old code: every field written differently was taken for a
    re-created pool, PoolChangedError ['log_stats', 'profile'] at that call and every
    later one: the engine stopped for good)."""
    m = _admitted_then_deleted(client, kind)
    same = _sliding(8)
    same.log_stats, same.profile = True, "vllm-0.16"
    client.create_pool("sw", same)
    with pytest.raises(RequestsLostError):  # the pool it was in is gone
        admit_prompt(m, hashed_req("b", list(range(40, 61))))
        m.flush()
    admit_prompt(m, hashed_req("c", list(range(9))))
    m.flush()
    assert [s.request_id for s in client.inspect_pool("sw", all_requests=True).requests] == ["c"]
    m.close()


@pytest.mark.parametrize("kind", ["waiting", "predicted"])
def test_a_pool_created_again_with_stats_turned_off_is_a_changed_pool(
    client: KVCoordClient, kind: str
) -> None:
    """The pool (log_stats unset: on) is created again with log_stats set false: its
    rules differ (no statistics kept), so the Attach after the loss is PoolChangedError
    naming log_stats (old code: compared the values only, unset and false both read
    False: taken for the same pool, the waiting engine went on without statistics and
    the predicted one lost every request at each Step, its mirror's statistics not the
    server's)."""
    m = _admitted_then_deleted(client, kind)
    other = _sliding(8)
    other.log_stats = False
    client.create_pool("sw", other)
    with pytest.raises((RequestsLostError, PoolChangedError)):  # (predicted: attached again at once)
        admit_prompt(m, hashed_req("d", list(range(40, 61))))
        m.flush()
    with pytest.raises(PoolChangedError) as info:
        admit_prompt(m, hashed_req("e", list(range(9))))
        m.flush()
    assert info.value.changes == ["log_stats"]
    assert not client.list_sessions("sw").sessions


def _admitted_then_deleted(client: KVCoordClient, kind: str) -> Any:
    """A ``kind`` ("waiting" or "predicted") session's manager of pool "sw" (a sliding
    window of 8) that admitted one request, the pool then deleted under it (forced)."""
    client.create_pool("sw", _sliding(8))
    m: Any = (
        RemoteKVCacheManager(client, "sw", hash_seed="0", renew=False, exclusive=True)
        if kind == "waiting"
        else PredictingKVCacheManager(client, "sw", hash_seed="0", renew=False)
    )
    admit_prompt(m, hashed_req("a", list(range(9))))
    m.flush()
    client.delete_pool("sw", force=True)
    return m
