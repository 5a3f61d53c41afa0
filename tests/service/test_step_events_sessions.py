"""Step batches, idempotency keys, the event stream and session leases, over real gRPC."""

from __future__ import annotations

import threading

import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import KVCoordClient, NotFoundError, SessionExpiredError
from kvcoord.client.errors import InvalidArgumentError, KeyReusedError
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb


def test_step_applies_in_order_and_aborts_after_failure(client: KVCoordClient) -> None:
    """Ops apply in order; the first failure gets its code, later ones ABORTED and unapplied."""
    sid, fence = attach(client)
    ops = [
        allocate("a", list(range(10)), 10),
        pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="a")),
        pb.Operation(free=pb.FreeOp(request_id="ghost")),
        pb.Operation(free=pb.FreeOp(request_id="a")),
    ]
    r = client.step("p", ops, sid, fence)
    codes = [x.status_code for x in r.results]
    assert codes == [0, 0, 5, 10]
    assert r.results[2].reason == pb.REQUEST_UNKNOWN and not r.results[2].position.exists
    assert [list(g.block_ids) for g in r.results[1].get_block_ids.groups] == [[1, 2, 3], [4, 5, 6]]
    assert "operation 2 failed" in r.results[3].status_message
    # "a" was not freed: it still holds its blocks
    assert r.num_free_blocks == 63 - 6
    assert client.inspect_pool("p", request_ids=["a"]).requests[0].num_tokens == 10


def test_idempotency_key_replays_the_first_answer(client: KVCoordClient) -> None:
    """A retried Step with the same key is answered from the cache, not applied twice;
    the same key with another body is refused (KEY_REUSED), applying nothing."""
    sid, fence = attach(client)
    req = pb.StepRequest(pool="p", session_id=sid, ops=[allocate("a", list(range(10)), 10)],
                         idempotency_key="k1", fence=fence)  # fmt: skip
    first = client.stub.Step(req, timeout=5)
    second = client.stub.Step(req, timeout=5)
    assert first == second
    assert client.get_stats("p").num_requests == 1
    assert client.get_stats("p").num_free_blocks == 63 - 6
    other = pb.StepRequest(pool="p", session_id=sid, ops=[allocate("b", list(range(10)), 10)],
                           idempotency_key="k1", fence=fence)  # fmt: skip
    with pytest.raises(KeyReusedError, match="another request body"):
        client._call("Step", other)
    assert client.get_stats("p").num_requests == 1


def test_failed_op_undoes_its_request_sync(client: KVCoordClient) -> None:
    """A request registered by an op that then fails is not left behind."""
    sid, fence = attach(client)
    r = client.step("p", [allocate("a", list(range(10)), 0)], sid, fence)
    assert r.results[0].status_code == 3
    with pytest.raises(NotFoundError):
        client.inspect_pool("p", request_ids=["a"])


def test_events_stream_resume_and_take(client: KVCoordClient) -> None:
    """WatchEvents numbers events 1, 2, ... and resumes after a sequence; TakeEvents drains
    (from the session's own cursor, which starts at Attach)."""
    sid, fence = attach(client)
    client.allocate("p", allocate("a", list(range(12)), 12).allocate, sid, fence)
    client.free("p", ["a"], session_id=sid, fence=fence)
    client.allocate("p", allocate("b", list(range(500, 620)), 120).allocate, sid, fence)  # reuses cached ones
    events = list(client.watch_events("p", 0, timeout=1.0))
    kinds = [e.event.WhichOneof("event") for e in events]
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert kinds[:2] == ["block_stored", "block_stored"]  # one per group
    assert "block_removed" in kinds
    resumed = list(client.watch_events("p", 2, timeout=1.0))
    assert [e.sequence for e in resumed] == [e.sequence for e in events[2:]]
    take = [pb.Operation(take_events=pb.TakeEventsOp())]
    taken = client.step("p", take, sid, fence).results[0].take_events
    assert list(taken.events) == [e.event for e in events] and not taken.gap
    assert not client.step("p", take, sid, fence).results[0].take_events.events  # drained
    # a cursor this history never reached is not an error any more: the stream starts
    # over from the oldest kept event, flagged reset (the subscriber's state is void)
    beyond = list(client.watch_events("p", 10_000, timeout=1.0))
    assert [e.sequence for e in beyond] == [e.sequence for e in events]
    assert beyond[0].reset and not any(e.reset for e in beyond[1:])
    assert all(e.fence == fence for e in events)


def test_events_gap_is_flagged(make_server: object) -> None:
    """A subscriber resuming before the oldest kept event is told there was a gap (on the
    first message after it only); so is a session whose TakeEvents cursor fell behind."""
    from conftest import POOL_TOML
    from kvcoord.service.registry import Limits

    srv = make_server(POOL_TOML, limits=Limits(event_buffer=3))  # type: ignore[operator]
    with KVCoordClient(srv.address) as c:
        sid, fence = attach(c)
        for i in range(4):
            c.allocate("p", allocate(f"r{i}", list(range(i * 100, i * 100 + 12)), 12).allocate, sid, fence)
        events = list(c.watch_events("p", 2, timeout=1.0))
        assert events[0].gap and events[0].sequence == 6
        assert not any(e.gap for e in events[1:])
        taken = c.step("p", [pb.Operation(take_events=pb.TakeEventsOp())], sid, fence).results[0].take_events
        assert taken.gap and list(taken.events) == [e.event for e in events]


def test_fresh_and_reset_watchers_are_told_of_dropped_events(make_server: object) -> None:
    """A watcher starting at after_sequence 0, or reset into another history, whose first
    event is not sequence 1 of the pool's current incarnation gets gap = true on it."""
    from conftest import POOL_TOML
    from kvcoord.service.registry import Limits

    srv = make_server(POOL_TOML, limits=Limits(event_buffer=3))  # type: ignore[operator]
    with KVCoordClient(srv.address) as c:
        sid, fence = attach(c)
        c.allocate("p", allocate("r0", list(range(12)), 12).allocate, sid, fence)
        kept = list(c.watch_events("p", 0, timeout=1.0))
        assert kept[0].sequence == 1 and not any(e.gap for e in kept)  # nothing dropped yet
        for i in range(1, 4):
            c.allocate("p", allocate(f"r{i}", list(range(i * 100, i * 100 + 12)), 12).allocate, sid, fence)
        fresh = list(c.watch_events("p", 0, timeout=1.0))
        assert fresh[0].sequence > 1 and fresh[0].gap and not fresh[0].reset
        assert not any(e.gap for e in fresh[1:])
        # a cursor beyond this history: reset, and the events before the oldest kept are gone
        beyond = list(c.watch_events("p", 10_000, timeout=1.0))
        assert beyond[0].reset and beyond[0].gap and beyond[0].sequence == fresh[0].sequence
        # the pool deleted and created again: its new history has dropped events too
        old = fresh[-1]
        cfg = c.get_pool("p").pool.config
        c.delete_pool("p")
        c.create_pool("p", cfg)
        sid, fence = attach(c)
        for i in range(4):
            c.allocate("p", allocate(f"s{i}", list(range(i * 100, i * 100 + 12)), 12).allocate, sid, fence)
        resumed = list(c.watch_events("p", old.sequence, timeout=1.0, fence=old.fence))
        assert resumed[0].reset and resumed[0].gap and resumed[0].sequence > 1
        assert not any(e.gap or e.reset for e in resumed[1:])


def test_watchers_after_a_journaled_restart_keep_the_numbering(tmp_path: object) -> None:
    """A journaled pool keeps its events and their numbering across a restart: a fresh
    watcher sees no gap while sequence 1 is still kept, and is told once it is not."""
    from conftest import POOL_TOML
    from kvcoord.service.registry import Limits

    limits = Limits(event_buffer=3)
    data = str(tmp_path)
    srv = InProcessServer(POOL_TOML, limits=limits, data_dir=data).start()
    try:
        with KVCoordClient(srv.address) as c:
            sid, fence = attach(c)
            c.allocate("p", allocate("r0", list(range(12)), 12).allocate, sid, fence)
            before = [e.sequence for e in c.watch_events("p", 0, timeout=1.0)]
    finally:
        srv.stop()
    srv = InProcessServer(POOL_TOML, limits=limits, data_dir=data).start()
    try:
        with KVCoordClient(srv.address) as c:
            after = list(c.watch_events("p", 0, timeout=1.0))
            assert [e.sequence for e in after] == before == [1, 2] and not any(e.gap for e in after)
            sid, fence = attach(c)
            for i in range(1, 3):
                c.allocate(
                    "p", allocate(f"r{i}", list(range(i * 100, i * 100 + 12)), 12).allocate, sid, fence
                )
            later = list(c.watch_events("p", 0, timeout=1.0))
            assert later[0].sequence > 1 and later[0].gap and not any(e.gap for e in later[1:])
    finally:
        srv.stop()


def test_watch_sees_later_events_live(client: KVCoordClient) -> None:
    """A subscriber receives events published after it subscribed."""
    got: list[int] = []

    def watch() -> None:
        for e in client.watch_events("p", 0, timeout=3.0):
            got.append(e.sequence)
            if len(got) >= 2:
                break

    sid, fence = attach(client)
    t = threading.Thread(target=watch)
    t.start()
    client.allocate("p", allocate("a", list(range(12)), 12).allocate, sid, fence)
    t.join(10)
    assert got == [1, 2]


def test_expired_session_frees_its_requests(
    server: InProcessServer, client: KVCoordClient, clock: ManualClock
) -> None:
    """A worker that stops renewing its lease loses its requests; the blocks only they
    held are no hits any more (their KV may never have been written: the worker may have
    died mid-step; test_abandoned_requests.py)."""
    sid, fence = attach(client, lease_seconds=5)
    tokens = list(range(200, 212))
    client.allocate("p", allocate("a", tokens, 12).allocate, sid, fence)
    assert client.get_stats("p").num_requests == 1
    clock.advance(4)
    client.heartbeat(sid)
    clock.advance(4)
    assert server.call(server.running.servicer.reap_expired_sessions) == 0  # type: ignore[union-attr]
    clock.advance(6)
    assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
    stats = client.get_stats("p")
    assert stats.num_requests == 0 and stats.num_free_blocks == 63
    with pytest.raises(SessionExpiredError, match="lease ran out"):
        client.heartbeat(sid)
    with pytest.raises(SessionExpiredError):  # and it can change nothing any more
        client.allocate("p", allocate("c", tokens, 12).allocate, sid, fence)
    hit = client.find_longest_cache_hit("p", hashes(tokens + [1]), 13).hit
    assert hit.num_tokens == 0


def test_a_lapsed_exclusive_session_no_reaper_ended_does_not_hold_its_pool(
    server: InProcessServer, client: KVCoordClient, clock: ManualClock
) -> None:
    """No reaper runs here (production's runs about once a second): an exclusive
    session whose lease ran out is ended by the next Attach of its pool, as the reaper
    would end it (its request freed, counted as expired), and that Attach is granted."""
    sid, fence = attach(client, lease_seconds=5, exclusive=True, client_name="engine-0")
    client.allocate("p", allocate("a", list(range(200, 212)), 12).allocate, sid, fence)
    clock.advance(6)
    again = client.attach("p", "sha256_cbor", 4, "0", client_name="engine-0", lease_seconds=5, exclusive=True)
    assert again.exclusive and again.session_id != sid
    assert [s.session_id for s in client.list_sessions("p").sessions] == [again.session_id]
    assert client.get_stats("p").num_requests == 0
    assert server.metrics is not None
    assert server.metrics.sessions_expired.labels("p")._value.get() == 1
    with pytest.raises(SessionExpiredError):
        client.detach(sid, fence)


def test_detach_frees_owned_requests(client: KVCoordClient) -> None:
    """Detach frees what the session still owns and reports how many (not another
    session's requests); a mutating call without a session is refused."""
    sid, fence = attach(client)
    other, other_fence = attach(client)
    client.allocate("p", allocate("a", list(range(8)), 8).allocate, sid, fence)
    client.allocate("p", allocate("b", list(range(8)), 8).allocate, other, other_fence)  # not owned by sid
    with pytest.raises(InvalidArgumentError, match="session_id is required"):
        client.allocate("p", allocate("c", list(range(8)), 8).allocate, "")
    assert client.detach(sid).num_freed_requests == 1
    assert client.get_stats("p").num_requests == 1
    assert [r.request_id for r in client.inspect_pool("p", all_requests=True).requests] == ["b"]
