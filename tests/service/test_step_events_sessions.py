"""Step batches, idempotency keys, the event stream and session leases, over real gRPC."""

from __future__ import annotations

import threading

import pytest
from helpers import allocate, new_request
from kvcoord.client import KVCoordClient, NotFoundError
from kvcoord.client.errors import InvalidArgumentError
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb


def test_step_applies_in_order_and_aborts_after_failure(client: KVCoordClient) -> None:
    """Ops apply in order; the first failure gets its code, later ones ABORTED and unapplied."""
    ops = [
        allocate("a", list(range(10)), 10),
        pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="a")),
        pb.Operation(free=pb.FreeOp(request_id="ghost")),
        pb.Operation(free=pb.FreeOp(request_id="a")),
    ]
    r = client.step("p", ops)
    codes = [x.status_code for x in r.results]
    assert codes == [0, 0, 5, 10]
    assert [list(g.block_ids) for g in r.results[1].get_block_ids.groups] == [[1, 2, 3], [4, 5, 6]]
    assert "operation 2 failed" in r.results[3].status_message
    # "a" was not freed: it still holds its blocks
    assert r.num_free_blocks == 63 - 6
    assert client.inspect_pool("p", request_ids=["a"]).requests[0].num_tokens == 10


def test_idempotency_key_replays_the_first_answer(client: KVCoordClient) -> None:
    """A retried Step with the same key is answered from the cache, not applied twice."""
    req = pb.StepRequest(pool="p", ops=[allocate("a", list(range(10)), 10)], idempotency_key="k1")
    first = client.stub.Step(req, timeout=5)
    second = client.stub.Step(req, timeout=5)
    assert first == second
    assert client.get_stats("p").num_requests == 1
    assert client.get_stats("p").num_free_blocks == 63 - 6


def test_failed_op_undoes_its_request_sync(client: KVCoordClient) -> None:
    """A request registered by an op that then fails is not left behind."""
    r = client.step("p", [allocate("a", list(range(10)), 0)])
    assert r.results[0].status_code == 3
    with pytest.raises(NotFoundError):
        client.inspect_pool("p", request_ids=["a"])


def test_events_stream_resume_and_take(client: KVCoordClient) -> None:
    """WatchEvents numbers events 1, 2, ... and resumes after a sequence; TakeEvents drains."""
    client.allocate("p", allocate("a", list(range(12)), 12).allocate)
    client.free("p", ["a"])
    client.allocate("p", allocate("b", list(range(500, 620)), 120).allocate)  # 60 blocks: reuses cached ones
    events = list(client.watch_events("p", 0, timeout=1.0))
    kinds = [e.event.WhichOneof("event") for e in events]
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert kinds[:2] == ["block_stored", "block_stored"]  # one per group
    assert "block_removed" in kinds
    resumed = list(client.watch_events("p", 2, timeout=1.0))
    assert [e.sequence for e in resumed] == [e.sequence for e in events[2:]]
    taken = client.step("p", [pb.Operation(take_events=pb.TakeEventsOp())]).results[0].take_events.events
    assert list(taken) == [e.event for e in events]
    with pytest.raises(InvalidArgumentError, match="beyond the pool's last event"):
        list(client.watch_events("p", 10_000, timeout=1.0))


def test_events_gap_is_flagged(make_server: object) -> None:
    """A subscriber resuming before the oldest kept event is told there was a gap."""
    from conftest import POOL_TOML
    from kvcoord.service.registry import Limits

    srv = make_server(POOL_TOML, limits=Limits(event_buffer=3))  # type: ignore[operator]
    with KVCoordClient(srv.address) as c:
        for i in range(4):
            c.allocate("p", allocate(f"r{i}", list(range(i * 100, i * 100 + 12)), 12).allocate)
        events = list(c.watch_events("p", 0, timeout=1.0))
        assert events[0].gap and events[0].sequence == 6
        assert not any(e.gap for e in events[1:])


def test_watch_sees_later_events_live(client: KVCoordClient) -> None:
    """A subscriber receives events published after it subscribed."""
    got: list[int] = []

    def watch() -> None:
        for e in client.watch_events("p", 0, timeout=3.0):
            got.append(e.sequence)
            if len(got) >= 2:
                break

    t = threading.Thread(target=watch)
    t.start()
    client.allocate("p", allocate("a", list(range(12)), 12).allocate)
    t.join(10)
    assert got == [1, 2]


def test_expired_session_frees_its_requests(
    server: InProcessServer, client: KVCoordClient, clock: ManualClock
) -> None:
    """A worker that stops renewing its lease loses its requests; cached blocks stay hits."""
    sid = client.attach("p", "sha256_cbor", 4, "0", lease_seconds=5).session_id
    tokens = list(range(200, 212))
    client.allocate("p", allocate("a", tokens, 12).allocate, session_id=sid)
    assert client.get_stats("p").num_requests == 1
    clock.advance(4)
    client.heartbeat(sid)
    clock.advance(4)
    assert server.call(server.running.servicer.reap_expired_sessions) == 0  # type: ignore[union-attr]
    clock.advance(6)
    assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
    stats = client.get_stats("p")
    assert stats.num_requests == 0 and stats.num_free_blocks == 63
    with pytest.raises(NotFoundError, match="expired"):
        client.heartbeat(sid)
    hit = client.find_longest_cache_hit("p", new_request("b", tokens + [1])).hit
    assert hit.num_tokens == 12


def test_detach_frees_owned_requests(client: KVCoordClient) -> None:
    """Detach frees what the session still owns and reports how many."""
    sid = client.attach("p", "sha256_cbor", 4, "0").session_id
    client.allocate("p", allocate("a", list(range(8)), 8).allocate, session_id=sid)
    client.allocate("p", allocate("b", list(range(8)), 8).allocate)  # no session: not owned
    assert client.detach(sid).num_freed_requests == 1
    assert client.get_stats("p").num_requests == 1
