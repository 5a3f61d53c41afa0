"""PredictingKVCacheManager over real gRPC: every layout it mirrors, which pools it
refuses, and what happens when the server's answers disagree with its mirror, refuse what it promised, or its
session ends under it. Its exactness under a faulty network is in
tests/reliability/test_faults.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcoord.client import (
    FailedPreconditionError,
    KVCoordClient,
    PoolBusyError,
    PredictingKVCacheManager,
    RemoteKVCacheManager,
    RequestsLostError,
)
from kvcoord.client.hashing import BlockHasher
from kvcoord.engine import BlockStored
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from support import NONE, Req, admit_prompt, hashed_req, lapse_predicted_session, wire_pool_config


def _tables(client: KVCoordClient, pool: str) -> dict[str, list[int]]:
    return {
        s.request_id: list(s.groups[0].block_ids)
        for s in client.inspect_pool(pool, all_requests=True).requests
    }


@pytest.fixture
def pool(client: KVCoordClient) -> str:
    client.create_pool("pred", wire_pool_config(32, events=True))
    return "pred"


def _spec(kind: str, **kw: Any) -> pb.KVCacheGroupSpec:
    return pb.KVCacheGroupSpec(**{kind: getattr(pb, _SPECS[kind])(**kw)})


_SPECS = {"full": "FullAttentionSpec", "sliding_window": "SlidingWindowSpec",
          "chunked_local": "ChunkedLocalAttentionSpec", "mamba": "MambaSpec"}  # fmt: skip

#: every layout the mirror follows (name -> groups, use_eagle)
_LAYOUTS: dict[str, tuple[list[pb.KVCacheGroupSpec], bool]] = {
    "full": ([_spec("full", block_size=4)], False),
    "full-sliding": ([_spec("full", block_size=4), _spec("sliding_window", block_size=4, sliding_window=8)], False),
    "full-chunked": ([_spec("full", block_size=4), _spec("chunked_local", block_size=4, attention_chunk_size=8)],
                     False),
    "sliding": ([_spec("sliding_window", block_size=4, sliding_window=8)], False),
    "full-mamba": ([_spec("full", block_size=8), _spec("mamba", block_size=8, mamba_cache_mode="all")], False),
    "eagle": ([_spec("full", block_size=4)], True),
    "full8-sliding": ([_spec("full", block_size=8), _spec("sliding_window", block_size=8, sliding_window=12)],
                      False),
}  # fmt: skip


def _layout_config(name: str, num_blocks: int) -> pb.PoolConfig:
    groups, eagle = _LAYOUTS[name]
    return pb.PoolConfig(num_blocks=num_blocks, hash_block_size=4, enable_caching=True, hash_algo="sha256_cbor",
                         hash_seed="0", enable_kv_cache_events=True, use_eagle=eagle, groups=groups)  # fmt: skip


def _all_tables(client: KVCoordClient, pool: str) -> dict[str, list[list[int]]]:
    return {
        s.request_id: [list(g.block_ids) for g in s.groups]
        for s in client.inspect_pool(pool, all_requests=True).requests
    }


def _grow(r: Any, tokens: list[int]) -> None:
    """Append tokens to a request, its block hashes with them (as vLLM's Request does)."""
    r.all_token_ids.extend(tokens)
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(r.all_token_ids)


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_every_layout_is_predicted_exactly(client: KVCoordClient, layout: str) -> None:
    """Hybrid, sliding-window, chunked-local, mamba and EAGLE pools are mirrored: on a
    pool used before (blocks cached, queue reordered), prefix hits, decode steps
    crossing block and window boundaries, frees, evictions and refusals are answered
    at once, and every answer equals the server's (the Steps' checks pass and the
    server holds exactly the tables told). (Before, only one full-attention group was
    predicted: every other layout was refused.)"""
    client.create_pool(layout, _layout_config(layout, 40))
    first = RemoteKVCacheManager(client, layout, hash_seed="0", renew=False)
    for i, tokens in enumerate([list(range(24)), list(range(24)), list(range(100, 121))]):
        first.allocate_slots(hashed_req(f"old{i}", tokens), len(tokens))
    first.close()  # frees everything: the blocks stay cached, the queue reordered
    m = PredictingKVCacheManager(client, layout, hash_seed="0", renew=False, max_backlog=2)
    # every block of the mirror made at attach, as vLLM's own pool makes them (its engine
    # core then freezes the heap: blocks made later would be walked by every full
    # collection); the answers below equal the server's all the same
    bp = m.mirror.engine.block_pool
    assert bp.free_block_queue.next_fresh == 40 and len(bp.blocks) == 40
    assert [b.block_id for b in bp.blocks] == list(range(40))
    reqs = [hashed_req("a", list(range(24)) + [7, 7, 7]), hashed_req("b", list(range(100, 121)) + [8]),
            hashed_req("c", list(range(300, 317)))]  # fmt: skip
    told: dict[str, list[list[int]]] = {}
    refused = 0
    for step in range(14):
        for r in reqs:
            if r.request_id in told:
                _grow(r, [1000 + step])
                new = m.allocate_slots(r, 1)
                if new is None:
                    refused += 1
                    continue
                r.num_computed_tokens += 1
            else:
                hit, hit_tokens = m.get_computed_blocks(r)
                new = m.allocate_slots(r, len(r.all_token_ids) - hit_tokens, hit_tokens, hit)
                if new is None:
                    refused += 1
                    continue
                r.num_computed_tokens = len(r.all_token_ids)
            told[r.request_id] = [list(g) for g in m.get_block_ids(r.request_id)]
        if step == 6:
            m.free(reqs[0])
            told.pop("a")
            reqs[0] = hashed_req("d", list(range(500, 530)))  # evicts cached blocks
        m.take_events()
    m.flush()
    assert m.lost_requests == 0 and m.steps_sent > 1
    assert _all_tables(client, layout) == told
    assert sorted(told) == ["b", "c", "d"]
    m.close()


def test_the_common_prefix_is_answered_at_once_and_checked_by_the_server(
    client: KVCoordClient, pool: str
) -> None:
    """get_num_common_prefix_blocks (vLLM's schedule() asks it every step) is the
    engine's answer, given at once and sent for the server to check: two requests
    sharing two cached blocks share a prefix of two, the server agrees (no loss at the
    flush), and a request the pool does not hold is refused with nothing sent."""
    from kvcoord.client import InvalidArgumentError

    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    a = hashed_req("a", list(range(12)))
    admit_prompt(m, a)
    assert m.get_num_common_prefix_blocks("a") == [3]  # the only holder: every block
    b = hashed_req("b", list(range(8)) + [90, 91, 92, 93])
    admit_prompt(m, b)  # hits a's first two blocks
    assert m.get_num_common_prefix_blocks("a") == [2]
    assert m.get_num_common_prefix_blocks("b") == [2]
    with pytest.raises(InvalidArgumentError, match="not in this pool"):
        m.get_num_common_prefix_blocks("ghost")
    m.take_events()
    m.flush()  # every answer above was the server's too
    assert m.lost_requests == 0
    assert sorted(_tables(client, pool)) == ["a", "b"]
    m.close()


def test_a_pool_held_by_another_session_or_another_engine_is_not_predicted(
    client: KVCoordClient, pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool another session holds is refused (PoolBusyError); a server whose engine
    has another rules fingerprint is refused with the reason named, and leaves no
    session behind (the pool is free for the next manager)."""
    other = RemoteKVCacheManager(client, pool, hash_seed="0", renew=False)
    with pytest.raises(PoolBusyError):
        PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    other.close()
    import kvcoord.service.pool_service as pool_service

    monkeypatch.setattr(pool_service, "rules_fingerprint", lambda: "state2-another-engine")
    with pytest.raises(FailedPreconditionError, match="engine rules are 'state2-another-engine'"):
        PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    monkeypatch.undo()
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)  # nothing left attached
    m.close()


def test_answers_equal_the_servers_from_a_used_pool(client: KVCoordClient, pool: str) -> None:
    """A pool used before (blocks cached, free queue reordered) is handed over whole:
    hits and new blocks answered at once equal what the server holds."""
    first = RemoteKVCacheManager(client, pool, hash_seed="0", renew=False)
    for i, tokens in enumerate([list(range(20)), list(range(20)), list(range(100, 117))]):
        r = Req(f"old{i}", tokens)
        first.allocate_slots(r, len(tokens))
        first.free(r)  # computed and finished: the blocks stay cached, the queue reordered
    first.close()
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    a = hashed_req("a", list(range(20)) + [7, 7, 7])
    b = hashed_req("b", list(range(100, 117)) + [8])
    told = {"a": admit_prompt(m, a), "b": admit_prompt(m, b)}
    assert told["a"][:5] == [1, 2, 3, 4, 5] and told["b"][:4] == [
        11,
        12,
        13,
        14,
    ]  # hits on the first's blocks
    m.flush()
    assert _tables(client, pool) == told
    m.close()


def _broken(
    client: KVCoordClient, pool: str, break_mirror: Callable[[PredictingKVCacheManager], None]
) -> tuple[PredictingKVCacheManager, RequestsLostError]:
    """Two admitted requests, the mirror changed under the manager, one more step:
    the next call reports what was lost."""
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    a, b = hashed_req("a", list(range(9))), hashed_req("b", list(range(50, 60)))
    admit_prompt(m, a)
    admit_prompt(m, b)
    m.take_events()
    break_mirror(m)
    c = hashed_req("c", list(range(200, 230)))
    admit_prompt(m, c)  # answered from the changed mirror
    m.take_events()
    with pytest.raises(RequestsLostError) as info:
        m.flush()
    return m, info.value


def test_a_server_that_disagrees_loses_every_request_loudly(client: KVCoordClient, pool: str) -> None:
    """The mirror's engine loses a block behind the manager's back: the server gives the
    next request other blocks; the answer's check reports every request the session held
    as lost, the session ends (the server frees them) and a new one starts from the
    server's state, whose answers are exact again."""

    def reorder(m: PredictingKVCacheManager) -> None:
        m.mirror.engine.block_pool.get_new_blocks(1)  # a block taken behind the manager's back

    m, lost = _broken(client, pool, reorder)
    assert sorted(lost.request_ids) == ["a", "b", "c"]
    assert lost.reason == "PREDICTION_FAILED"
    assert m.lost_requests == 3
    assert _tables(client, pool) == {}  # the old session's requests are freed
    d = hashed_req("d", list(range(9)))
    told = admit_prompt(m, d)  # a hit on a's cached blocks, from the new state
    m.flush()
    assert _tables(client, pool) == {"d": told}
    m.close()


def test_a_promise_the_server_refuses_loses_every_request(client: KVCoordClient, pool: str) -> None:
    """The mirror believes blocks are free that are not: it answers an allocation the
    server must refuse; the server refuses the Step's promise (PREDICTION_FAILED) and
    the next call reports every request lost."""

    def phantom(m: PredictingKVCacheManager) -> None:
        m.mirror.engine.free("a")  # behind the manager's back: the server still holds a's blocks

    client.delete_pool(pool)
    client.create_pool(pool, wire_pool_config(12, events=True))
    m, lost = _broken(client, pool, phantom)
    assert sorted(lost.request_ids) == ["a", "b", "c"]
    assert _tables(client, pool) == {}
    m.close()


def test_an_expired_session_loses_every_request_and_starts_again(
    make_server: Callable[..., InProcessServer], clock: ManualClock
) -> None:
    """The server ends the session (its lease ran out there): the Step sent after is
    refused, the next call reports every request lost, and the manager attaches again."""
    server = make_server("")
    with KVCoordClient(server.address, timeout=10) as c:
        m, _ = lapse_predicted_session(c, server, clock)  # "b" answered: the client vouches for its lease
        with pytest.raises(RequestsLostError) as info:
            m.flush()
        assert sorted(info.value.request_ids) == ["a", "b"]
        assert info.value.reason == "SESSION_EXPIRED"
        told = admit_prompt(m, hashed_req("c", list(range(9))))
        m.flush()
        assert _tables(c, "p") == {"c": told}
        m.close()


def test_a_lapsed_session_no_reaper_ended_is_recovered_from(
    make_server: Callable[..., InProcessServer], clock: ManualClock
) -> None:
    """The session's lease ran out on the server and no reaper ended it yet (the
    lapsed exclusive session still sits in the table): the manager's recovery ends it and
    attaches again at once instead of being refused the pool by its own lost session."""
    server = make_server("")
    with KVCoordClient(server.address, timeout=10) as c:
        m, lost = lapse_predicted_session(c, server, clock, reap=False)  # and nothing reaps
        with pytest.raises(RequestsLostError) as info:
            m.flush()
        assert sorted(info.value.request_ids) == ["a", "b"]
        assert m.keeper.session_id != lost
        told = admit_prompt(m, hashed_req("c", list(range(9))))
        m.flush()
        assert _tables(c, "p") == {"c": told}
        assert [s.session_id for s in c.list_sessions("p").sessions] == [m.keeper.session_id]
        m.close()


def test_bad_calls_are_refused_before_anything_is_sent(client: KVCoordClient, pool: str) -> None:
    """Bad counts raise InvalidArgumentError (the engine's own message, as the server
    would answer) and change nothing, neither in the mirror nor on the server."""
    from kvcoord.client import InvalidArgumentError

    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    r = hashed_req("a", list(range(9)))
    free = m.mirror.num_free_blocks
    with pytest.raises(InvalidArgumentError, match="num_new_tokens must be > 0"):
        m.allocate_slots(r, 0)
    with pytest.raises(InvalidArgumentError, match="exceed max_model_len"):
        m.allocate_slots(r, (1 << 31) + 1)
    with pytest.raises(InvalidArgumentError, match="past the request's 9 tokens"):
        m.cache_blocks(r, 12)
    assert m.mirror.num_free_blocks == free and "a" not in m.tracker and not m.mirror.holds("a")
    m.flush()
    assert _tables(client, pool) == {}
    told = admit_prompt(m, r)  # the same request, well asked: answered and held
    m.flush()
    assert _tables(client, pool) == {"a": told}
    m.close()


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_tokens_the_wire_cannot_carry_are_refused_at_the_call(
    client: KVCoordClient, pool: str, bad: int
) -> None:
    """The mirror applies a request's tokens as they stand (no message is made on the
    scheduler's thread): a token id the wire's uint32 cannot carry is refused then, as
    InvalidArgumentError, with nothing queued for the server, not found later on the
    sender thread (nor raised untyped by the message's field)."""
    from kvcoord.client import InvalidArgumentError

    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    free = m.mirror.num_free_blocks
    wrong = hashed_req("a", [1, 2, bad, 4, 5, 6, 7, 8, 9])
    with pytest.raises(InvalidArgumentError):
        m.get_computed_blocks(wrong)
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(wrong, 9)
    assert m.mirror.num_free_blocks == free and "a" not in m.tracker and not m.mirror.holds("a")
    m.flush()
    assert _tables(client, pool) == {}
    told = admit_prompt(m, hashed_req("a", list(range(9))))  # the id, with tokens the wire carries
    m.flush()
    assert _tables(client, pool) == {"a": told}
    m.close()


def test_kv_connector_tokens_and_delayed_caching_are_predicted(client: KVCoordClient, pool: str) -> None:
    """A KV connector's external tokens with delayed caching, then cache_blocks once
    the load is done, as vLLM's scheduler calls them: answered from the mirror, equal
    to the server's (a second request hits the blocks cached late). (Before, the
    predicting manager refused them.)"""
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    r = hashed_req("a", list(range(17)))
    new = m.allocate_slots(r, 1, num_external_computed_tokens=16, delay_cache_blocks=True)
    assert new is not None and len(new.block_ids[0]) == 1  # the four external blocks are not new
    table = m.get_block_ids("a")[0]
    assert len(table) == 5 and table[-1] == new.block_ids[0][0]
    r.num_computed_tokens = 16
    m.cache_blocks(r, 16)
    r.num_computed_tokens = 17
    m.take_events()
    b = hashed_req("b", list(range(17)) + [5])
    told_b = admit_prompt(m, b)
    assert told_b[:4] == table[:4]  # hits the four blocks cached late
    m.flush()
    assert _tables(client, pool) == {"a": table, "b": told_b}
    m.close()


@pytest.mark.parametrize("computed", [0, 8])
def test_a_registration_carries_its_computed_tokens_into_the_mirror(
    client: KVCoordClient, pool: str, computed: int
) -> None:
    """A request registered by its first allocation with tokens already computed (0 or
    more: the mirror skips the update that would set a new record's 0 again) is
    allocated from there by the mirror as by the server: its new blocks cover only the
    tokens past them."""
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    r = hashed_req("a", list(range(20)))
    r.num_computed_tokens = computed
    new = m.allocate_slots(r, 4)
    assert new is not None and len(new.block_ids[0]) == (computed + 4) // 4
    assert m.mirror.engine.requests["a"].num_computed_tokens == computed
    m.flush()  # the server's answer is the mirror's
    assert _tables(client, pool) == {"a": m.get_block_ids("a")[0]}
    m.close()


def test_an_events_digest_is_the_digest_of_the_events(client: KVCoordClient) -> None:
    """Step.events_digest answers, instead of the events, the SHA-256 of a StepResponse
    holding only them: the same operations on two pools, one answered each way."""
    import hashlib

    answers = []
    for name, digest in (("ev-full", False), ("ev-digest", True)):
        client.create_pool(name, wire_pool_config(16, events=True))
        s = client.attach(name, "sha256_cbor", 4, "0")
        tokens = list(range(30))
        op = pb.Operation()
        op.allocate.request.request_id = "a"
        op.allocate.request.new_request = True
        op.allocate.request.append_token_ids.extend(tokens)
        op.allocate.request.append_block_hashes.extend(BlockHasher("sha256_cbor", 4, NONE).extend(tokens))
        op.allocate.num_new_tokens = 30
        request = pb.StepRequest(pool=name, session_id=s.session_id, fence=s.fence, ops=[op], include_state=True,
                                 events_digest=digest)  # fmt: skip
        answers.append(client.send_step(request))
    full, digested = answers
    assert len(full.events) == 1 and not digested.events
    assert (
        digested.events_sha256
        == hashlib.sha256(pb.StepResponse(events=full.events).SerializeToString()).digest()
    )
    assert not full.events_sha256


def test_events_the_server_did_not_make_lose_every_request(client: KVCoordClient, pool: str) -> None:
    """A mirror whose events differ from the server's (its allocations still agree) is
    caught by the events digest: every request is reported lost."""

    def wrong_events(m: PredictingKVCacheManager) -> None:
        original = m.mirror.take_step

        def take_step() -> tuple[int, list[Any], pb.PrefixCacheStats]:
            free, events, stats = original()
            return (
                free,
                [dataclasses.replace(e, medium="CPU") if isinstance(e, BlockStored) else e for e in events],
                stats,
            )

        m.mirror.take_step = take_step  # type: ignore[method-assign]

    m, lost = _broken(client, pool, wrong_events)
    assert sorted(lost.request_ids) == ["a", "b", "c"]
    assert "KV events differ" in str(lost)
    m.close()


def test_a_call_refused_before_it_is_sent_leaves_the_step_whole(client: KVCoordClient, pool: str) -> None:
    """A lookup under a tracked id with another prompt, and an allocation of a request
    reported lost that the scheduler did not preempt, are refused (InvalidArgumentError,
    LostRequestInUseError) and nothing of them reaches the server: the next Step
    succeeds and the session's requests stay. (Before, the refused call's operation
    stayed in the Step half-written; the server refused the Step and every request was
    reported lost.)"""
    from kvcoord.client import InvalidArgumentError, KVCoordError
    from kvcoord.client.tracking import LostRequestInUseError

    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False, max_backlog=0)
    a = hashed_req("a", list(range(9)))
    told = admit_prompt(m, a)
    m.flush()
    with pytest.raises(InvalidArgumentError):
        m.get_computed_blocks(hashed_req("a", [77, 78]))  # same id, another prompt
    m.take_events()
    m.flush()
    assert _tables(client, pool) == {"a": told}
    m.sender.failure = KVCoordError(grpc.StatusCode.UNAVAILABLE, "a Step failed")  # as the sender records one
    with pytest.raises(RequestsLostError):
        m.flush()
    b = hashed_req("b", list(range(100, 109)))
    told_b = admit_prompt(m, b)
    with pytest.raises(LostRequestInUseError):
        m.allocate_slots(a, 1)  # 'a' was reported lost: the scheduler must preempt it first
    m.flush()
    assert _tables(client, pool) == {"b": told_b}
    m.close()


def test_steps_join_while_one_is_in_flight_up_to_a_size(client: KVCoordClient, pool: str) -> None:
    """While a Step is in flight, the next scheduler steps' calls join the next Step
    (at most max_backlog steps), unless it has grown past max_step_bytes: then the
    manager waits for the answer in flight and sends it."""
    import concurrent.futures
    import threading

    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False, max_backlog=4)
    admit_prompt(m, hashed_req("a", list(range(9))))
    m.flush()
    blocker: concurrent.futures.Future[None] = concurrent.futures.Future()
    m.sender.in_flight = blocker  # a Step whose answer has not come
    admit_prompt(m, hashed_req("b", list(range(20, 29))))
    m.take_events()
    assert m.sender.backlog == 1 and len(m.sender.pending.request.ops) == 2  # joined the next Step
    m.sender.max_step_bytes = 1
    admit_prompt(m, hashed_req("c", list(range(40, 49))))
    threading.Timer(0.2, blocker.set_result, (None,)).start()
    sent = m.steps_sent
    m.take_events()  # too big to wait: waits for the answer in flight, then sends
    assert m.steps_sent == sent + 1 and m.sender.backlog == 0 and not m.sender.pending.request.ops
    m.flush()
    assert sorted(_tables(client, pool)) == ["a", "b", "c"]
    m.close()


def test_the_sender_threads_step_is_in_flight_until_answered(client: KVCoordClient, pool: str) -> None:
    """The Step handed to the sender thread is in flight (the next steps' calls join
    the next Step) until its answer is checked, and ``flush`` waits for it."""
    import threading

    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False, max_backlog=4)
    sender = m.sender
    go, started = threading.Event(), threading.Event()
    checked = sender._checked_step

    def held(sent: Any) -> None:
        started.set()
        assert go.wait(60), "the test never let the Step go"
        checked(sent)

    sender._checked_step = held  # type: ignore[method-assign]
    admit_prompt(m, hashed_req("a", list(range(9))))
    m.take_events()
    assert started.wait(60)
    flight = sender.in_flight
    assert flight is not None and not flight.done()
    admit_prompt(m, hashed_req("b", list(range(20, 29))))
    m.take_events()
    assert sender.backlog == 1 and m.steps_sent == 1  # joined the next Step
    threading.Timer(0.2, go.set).start()
    m.flush()  # waits for the first Step, then sends and waits for the second
    assert flight.done() and m.steps_sent == 2 and sorted(_tables(client, pool)) == ["a", "b"]
    m.close()
    assert sender.inbox.thread is None  # the sender thread stopped


def test_anything_a_step_raises_loses_the_requests_and_the_sender_goes_on(
    client: KVCoordClient, pool: str
) -> None:
    """Even a BaseException raised on the sender thread is the Step's failure: the next
    call reports every request lost, and the sender thread sends the next Steps."""
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    checked = m.sender._checked_step
    raised = []

    def once(sent: Any) -> None:
        if not raised:
            raised.append(True)
            raise SystemExit("on the sender thread")
        checked(sent)

    m.sender._checked_step = once  # type: ignore[method-assign]
    admit_prompt(m, hashed_req("a", list(range(9))))
    with pytest.raises(RequestsLostError) as info:
        m.flush()
    assert info.value.request_ids == ["a"] and "SystemExit" in str(info.value)
    assert admit_prompt(m, hashed_req("b", list(range(20, 29))))
    m.flush()
    assert _tables(client, pool) == {"b": m.get_block_ids("b")[0]}
    m.close()


_SMALL_BUFFER = "[limits]\nevent_buffer = 8\n"


def _evicting_step(m: PredictingKVCacheManager, prefix: str, base: int) -> dict[str, list[int]]:
    """Six requests of five blocks each in one scheduler step (30 of the pool's 31
    usable blocks): every block another prompt cached is evicted, far more KV events
    than an event buffer of 8 keeps."""
    told = {}
    for i in range(6):
        r = hashed_req(f"{prefix}{i}", list(range(base + 20 * i, base + 20 * i + 20)))
        told[r.request_id] = admit_prompt(m, r)
    return told


def test_a_large_eviction_is_no_disagreement(make_server: Callable[..., InProcessServer]) -> None:
    """An event buffer of 8 and a step evicting 30 cached blocks: the server's buffer
    wraps, its answer says events_gap and digests only the events it kept. The manager
    does not compare those events (it compares everything else) and loses nothing; the
    engine still gets the mirror's events, all of them. (Before, any events_gap was a
    mismatch: every request the session held was reported lost.)"""
    server = make_server(_SMALL_BUFFER)
    with KVCoordClient(server.address, timeout=10) as client:
        client.create_pool("gap", wire_pool_config(32, events=True))
        m = PredictingKVCacheManager(client, "gap", hash_seed="0", renew=False, max_backlog=0)
        first = _evicting_step(m, "a", 0)
        for rid in first:
            m.free(rid)  # cached, free: the next prompts evict them
        m.take_events()
        m.flush()
        assert m.events_gaps == 0
        second = _evicting_step(m, "b", 1000)
        events = m.take_events()
        m.flush()  # raised RequestsLostError before
        removed = [e for e in events if e.WhichOneof("event") == "block_removed"]
        stored = [e for e in events if e.WhichOneof("event") == "block_stored"]
        # each request stored its blocks; all but the pool's one never-used block were evicted
        assert len(stored) == 6 and len(removed) == 29 and len(events) > 8
        assert m.events_gaps == 1 and m.lost_requests == 0
        assert _tables(client, "gap") == second  # every request still held, as told
        m.close()


def test_a_real_difference_is_caught_across_an_event_gap(make_server: Callable[..., InProcessServer]) -> None:
    """The same large eviction, with the mirror's statistics, or one of its block ids,
    made to differ from the server's in that step: the events are not compared, but the
    difference is still found and every request reported lost."""
    server = make_server(_SMALL_BUFFER)
    with KVCoordClient(server.address, timeout=10) as client:
        for n, breaking in enumerate(("stats", "blocks")):
            pool = f"gap-{breaking}"
            client.create_pool(pool, wire_pool_config(32, events=True))
            m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False, max_backlog=0)
            for rid in _evicting_step(m, "a", 0):
                m.free(rid)
            m.take_events()
            m.flush()
            _evicting_step(m, "b", 1000)
            if breaking == "stats":
                m.mirror.step_stats.hits += 4  # the mirror counts a hit the server did not
            else:
                run = m.sender.run
                assert run is not None
                i = max(j for j, e in enumerate(run.news) if any(e))
                new = run.news[i]
                last = max(g for g, ids in enumerate(new) if ids)
                wrong = tuple(ids[:-1] + (ids[-1] + 1,) if g == last else ids for g, ids in enumerate(new))
                run.news[i] = wrong  # one block id the server will not give
            m.take_events()
            with pytest.raises(RequestsLostError) as info:
                m.flush()
            assert sorted(info.value.request_ids) == [f"b{i}" for i in range(6)], n
            assert "differ" in str(info.value)
            # the statistics are compared after the events (not compared, the gap
            # counted); the run of allocations before them
            assert m.events_gaps == (breaking == "stats")
            assert _tables(client, pool) == {}
            m.close()


_TENANTS = """
[tenants.alice]
tokens = ["tok-alice"]
grants = [{ pools = ["t*"], roles = ["use", "observe", "administer"] }]

[tenants.bob]
tokens = ["tok-bob"]
grants = [{ pools = ["t*"], roles = ["use", "observe", "administer"] }]
"""


def test_a_tenants_namespace_is_predicted(make_server: Callable[..., InProcessServer]) -> None:
    """A pool whose tenants cache apart: Bob caches prompts, then Alice's exclusive
    session is predicted. Her requests of the same prompts do not hit Bob's blocks,
    her allocations evict some of them, and the events she is owed are her own
    namespace's only (Bob's blocks' removals are not hers to see): every answer, the
    events digest included, equals the server's. (Before, a tenant's namespace was
    refused.)"""
    from tenancy import pool_toml

    server = make_server(_TENANTS + pool_toml("tpool"))
    with KVCoordClient(server.address, timeout=10, token="tok-bob") as bob:
        m = RemoteKVCacheManager(bob, "tpool", hash_seed="0", renew=False)
        for i in range(3):
            tokens = list(range(100 * i, 100 * i + 32))
            assert m.allocate_slots(hashed_req(f"bob{i}", tokens), 32) is not None
        m.close()  # 24 of Bob's blocks stay cached, free
    with KVCoordClient(server.address, timeout=10, token="tok-alice") as alice:
        m = PredictingKVCacheManager(alice, "tpool", hash_seed="0", renew=False)
        assert m.mirror.namespace == "alice"
        told = {}
        for i in range(5):  # 5 x 10 blocks: past the 39 never-used ones, into Bob's cached ones
            r = hashed_req(f"alice{i}", list(range(100 * i, 100 * i + 40)))
            hit, hit_tokens = m.get_computed_blocks(r)
            assert hit_tokens == 0  # Bob's blocks are not Alice's hits
            new = m.allocate_slots(r, 40, 0, hit)
            assert new is not None
            told[r.request_id] = list(new.block_ids[0])
        events = m.take_events()
        m.flush()
        assert m.lost_requests == 0
        assert _tables(alice, "tpool") == told
        assert {e.WhichOneof("event") for e in events} == {"block_stored"}  # no removal of Bob's
        assert len(events) == 5
        m.close()


def test_a_pool_holding_a_routers_reservation_is_not_predicted(client: KVCoordClient, pool: str) -> None:
    """A router's reservation ends by the server's doing (its time runs out, or a
    request adopts it), which a mirror would not follow: while one is live the pool
    is refused with the reason (FailedPreconditionError, no session left behind), and
    the waiting manager still takes it."""
    warm = RemoteKVCacheManager(client, pool, hash_seed="0", renew=False)
    tokens = list(range(500, 541))
    w = hashed_req("w", tokens)
    warm.allocate_slots(w, len(tokens))
    warm.free(w)  # computed and finished: its blocks stay cached
    warm.close()
    prompt = pb.HashedPrompt(hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0",
                             block_hashes=BlockHasher("sha256_cbor", 4, NONE).extend(tokens))  # fmt: skip
    reserved = client.score_pools(len(tokens), [prompt], candidate_pools=[pool], reserve_seconds=30.0)
    assert reserved.reservation.pool == pool and reserved.reservation.hit_tokens == 40
    with pytest.raises(FailedPreconditionError, match="routers' reservations"):
        PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    RemoteKVCacheManager(
        client, pool, hash_seed="0", renew=False, exclusive=True
    ).close()  # nothing left attached


@pytest.mark.parametrize("bad", [-1, 1 << 32])
@pytest.mark.parametrize("path", ["run", "general"])
def test_a_decode_token_the_wire_cannot_carry_is_refused_at_the_call(
    client: KVCoordClient, pool: str, bad: int, path: str
) -> None:
    """A registered request's decode step appends a token id the wire's uint32 cannot
    carry: the call is refused (InvalidArgumentError) with nothing queued or changed,
    and the session goes on. (Before, the run path took it into the mirror and the
    sender thread failed writing the Step: every request of the session was lost.)"""
    from kvcoord.client import InvalidArgumentError

    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    r = hashed_req("a", list(range(6)))
    told = admit_prompt(m, r)
    r.num_computed_tokens = 6
    m.flush()
    free = m.mirror.num_free_blocks
    r.all_token_ids.append(bad)
    with pytest.raises(InvalidArgumentError):
        if path == "run":
            m.allocate_slots(r, 1)
        else:
            m.allocate_slots(r, 1, delay_cache_blocks=True)
    assert m.mirror.num_free_blocks == free
    m.flush()
    assert _tables(client, pool) == {"a": told}
    r.all_token_ids[-1] = 6  # the step again, with a token the wire carries
    assert m.allocate_slots(r, 1) is not None
    m.flush()
    assert _tables(client, pool) == {"a": list(m.mirror.engine.get_block_ids("a")[0])}
    m.close()


def test_a_registration_whose_extra_keys_fail_can_be_made_again(client: KVCoordClient, pool: str) -> None:
    """The tracker's hook for a request's extra-key sources (the vLLM 0.33 plug-in's)
    raises on the first registration: the call fails and the tracker is left as before,
    so the next call registers the whole prompt. (Before, the tracker had already
    counted the prompt as sent: the next registration carried no tokens and was
    refused.)"""
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    calls: list[int] = []

    def extra(request: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("digest failed")

    m.tracker.extra_keys_of = extra
    r = hashed_req("a", list(range(9)))
    with pytest.raises(RuntimeError):
        m.get_computed_blocks(r)
    m.get_computed_blocks(r)
    assert list(m.mirror.engine.requests["a"].all_token_ids) == list(range(9))
    m.close()


def test_a_lookup_that_fails_in_the_mirror_leaves_nothing_to_send(
    client: KVCoordClient, pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror's lookup raises after the request's sync was applied: the call fails,
    the sync is undone and its operation taken back, so the next Step holds only whole
    operations and the session goes on. (Before, an operation with nothing set was
    left in the Step: the server refused it and the session's requests were lost.)"""
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    lookup = m.mirror.lookup

    def failing(request_id: str) -> object:
        monkeypatch.setattr(m.mirror, "lookup", lookup)
        raise RuntimeError("lookup failed")

    monkeypatch.setattr(m.mirror, "lookup", failing)
    r = hashed_req("a", list(range(9)))
    with pytest.raises(RuntimeError):
        m.get_computed_blocks(r)
    assert not m.mirror.holds("a")
    told = admit_prompt(m, r)
    m.flush()
    assert _tables(client, pool) == {"a": told}
    m.close()


@pytest.mark.parametrize("advertised", [True, False])
def test_decode_steps_go_as_a_decode_op_where_the_server_applies_one(
    client: KVCoordClient, pool: str, advertised: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server listing "decode_op" in AttachResponse.capabilities gets each Step's run
    of allocations as one DecodeOp (must_succeed); one that does not, as an
    AllocateRunOp. Either way every answer equals the mirror's and the server holds
    the tables told."""
    from kvcoord.client.sender import StepSender
    from kvcoord.service import session_calls

    if not advertised:
        monkeypatch.setattr(session_calls, "CAPABILITIES", ())
    kinds: list[str] = []
    send = StepSender._send

    def recording(self: StepSender, request: pb.StepRequest, *args: Any, **kw: Any) -> Any:
        kinds.extend(str(o.WhichOneof("op")) for o in request.ops)
        assert all(o.decode.must_succeed for o in request.ops if o.HasField("decode"))
        return send(self, request, *args, **kw)

    monkeypatch.setattr(StepSender, "_send", recording)
    m = PredictingKVCacheManager(client, pool, hash_seed="0", renew=False)
    reqs = [hashed_req(f"r{i}", list(range(10 * i, 10 * i + 6))) for i in range(3)]
    told = {r.request_id: admit_prompt(m, r) for r in reqs}
    for step in range(9):
        for r in reqs:
            _grow(r, [900 + step])
            new = m.allocate_slots(r, 1)
            assert new is not None
            r.num_computed_tokens += 1
            told[r.request_id] = list(m.get_block_ids(r.request_id)[0])
        m.take_events()
    m.flush()
    assert m.lost_requests == 0
    assert _tables(client, pool) == told
    assert ("decode" in kinds) == advertised and ("allocate_run" in kinds) != advertised
    m.close()
