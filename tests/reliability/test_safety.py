"""The remote-safety scenarios users met, each against a real server over gRPC:
idle workers, dead workers, restarts, shared keys, event streams, bad bytes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvcoord.client import (
    NO_RETRY,
    AbortedError,
    FencedError,
    GracePeriodError,
    InvalidArgumentError,
    KeyReusedError,
    KVCoordClient,
    PermissionDeniedError,
    RemoteKVCacheManager,
    RequestsLostError,
    RetryPolicy,
)
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.service.data_dir_lock import DataDirInUseError
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import allocate_op
from ports import free_port
from support import POOL_TOML as POOL
from support import Req


def held(client: KVCoordClient, pool: str = "p") -> dict[str, list[list[int]]]:
    resp = client.inspect_pool(pool, all_requests=True)
    return {r.request_id: [list(g.block_ids) for g in r.groups] for r in resp.requests}


@pytest.fixture
def started() -> Iterator[list[InProcessServer]]:
    servers: list[InProcessServer] = []
    yield servers
    for s in servers:
        s.stop()


def start(started: list[InProcessServer], **kw: object) -> InProcessServer:
    s = InProcessServer(POOL, **kw).start()  # type: ignore[arg-type]
    started.append(s)
    return s


def test_idle_worker_keeps_its_session(started: list[InProcessServer]) -> None:
    """A worker idle for three leases keeps its session and blocks: the client renews.

    The lease (0.6 s) is counted on a clock the server and the worker share and the
    test moves: half a lease at a time, each time once the worker's own renewal thread
    renewed the lease at the current time. Counted in real time, a process starved
    past the lease (2 cores at load 8, stalls injected with SIGSTOP) really loses its
    session on both sides, by the lease's contract."""
    clock = ManualClock()
    lease = 0.6
    server = start(started, clock=clock, session_lease_seconds=lease, max_session_lease_seconds=lease,
                   idempotency_window_seconds=300.0)  # fmt: skip
    with KVCoordClient(server.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", clock=clock)
        r = Req("a", list(range(10)))
        blocks = m.allocate_slots(r, 10)
        assert blocks is not None
        for _ in range(7):  # 3.5 leases idle; the server reaps expired sessions meanwhile
            # The keeper's next heartbeat, and one sent at the current time answered (one
            # sent before the last advance leaves less than half a lease): the server
            # received it now or later.
            renewals, deadline = m.keeper.renewals, time.monotonic() + 60  # a bound on a hang
            while m.keeper.renewals == renewals or m.keeper.valid_until <= clock.now + lease / 2:
                assert time.monotonic() < deadline, "the worker renewed nothing for 60 s"
                time.sleep(0.02)
            clock.advance(lease / 2)
            server.call(server.running.servicer.reap_expired_sessions)  # type: ignore[union-attr]
        assert held(c)["a"] == [list(x) for x in blocks.get_block_ids()]
        r.num_computed_tokens = 10
        assert m.allocate_slots(r, 4) is not None  # still works, nothing lost
        assert m.lost_requests == 0
        m.close()


def test_dead_worker_blocks_are_freed_and_sessionless_calls_refused(started: list[InProcessServer]) -> None:
    """A worker that stops renewing loses its requests at lease end; a call without a
    session can never hold a block."""
    clock = ManualClock()
    server = start(started, clock=clock)
    with KVCoordClient(server.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False)
        assert m.allocate_slots(Req("a", list(range(12))), 12) is not None
        assert "a" in held(c)
        clock.advance(31)  # the default lease is 30 s; the worker is gone
        server.call(server.running.servicer.reap_expired_sessions)  # type: ignore[union-attr]
        assert held(c) == {}
        assert c.get_stats("p").num_free_blocks == 63
        op = allocate_op(pb.RequestSync(request_id="x", append_token_ids=[1, 2], new_request=True), 2)
        with pytest.raises(Exception) as err:
            c.step("p", [pb.Operation(allocate=op)], session_id="")
        assert "session_id is required" in str(err.value)
        assert held(c) == {}


def test_lost_lease_stops_block_ids_and_reports_lost_requests(started: list[InProcessServer]) -> None:
    """Partitioned past its lease, the worker hands out no block id; once reachable it
    re-attaches and names the requests that were lost."""
    clock = ManualClock()
    server = start(started, clock=clock, session_lease_seconds=0.5, max_session_lease_seconds=0.5,
                   idempotency_window_seconds=300.0)  # fmt: skip
    fi = FaultInjector(1)
    with KVCoordClient(server.address, interceptors=[fi], retry=NO_RETRY) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False)
        r = Req("a", list(range(8)))
        assert m.allocate_slots(r, 8) is not None
        fi.partitioned = True
        time.sleep(0.6)  # the client's lease (counted from its last answered call) ran out
        r.num_computed_tokens = 8
        with pytest.raises(RequestsLostError) as lost:
            m.allocate_slots(r, 4)
        assert lost.value.request_ids == ["a"]
        clock.advance(1)  # meanwhile the server expired the session and freed "a"
        server.call(server.running.servicer.reap_expired_sessions)  # type: ignore[union-attr]
        fi.partitioned = False
        assert m.allocate_slots(Req("b", list(range(8))), 8) is not None  # re-attached
        assert set(held(c)) == {"b"}
        assert m.lost_requests == 1


def test_restart_is_detected_and_old_block_ids_are_void(started: list[InProcessServer]) -> None:
    """After the server restarts (state lost), the next call raises RequestsLostError
    naming every request; the fence changed; the manager carries on with a new session."""
    port = free_port()  # (restarted on it: none from the ephemeral range, see tests/ports.py)
    first = start(started, port=port)
    with KVCoordClient(first.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        assert m.allocate_slots(Req("a", list(range(8))), 8) is not None
        old_fence = pb.Fence()
        old_fence.CopyFrom(m.keeper.fence)
        first.stop()
        started.remove(first)
        start(started, port=port)
        with pytest.raises(RequestsLostError) as lost:
            m.allocate_slots(Req("b", list(range(8))), 8)
        # "a" and "b" (registered by the very call that met the new instance) are lost.
        assert lost.value.request_ids == ["a", "b"]
        assert isinstance(lost.value.cause, FencedError)
        assert m.keeper.fence.instance_id != old_fence.instance_id
        assert m.allocate_slots(Req("b", list(range(8))), 8) is not None
        with pytest.raises(FencedError):
            c.heartbeat(m.session_id, old_fence)
        m.close()


def test_restart_grace_period_hands_out_nothing(started: list[InProcessServer], tmp_path: Path) -> None:
    """A server restarted while its predecessor's leases may run refuses to attach
    (GRACE_PERIOD) until they have ended."""
    first = start(started, data_dir=str(tmp_path), durability="none")
    with KVCoordClient(first.address) as c:
        c.attach("p", "sha256_cbor", 4, "0")
    assert (tmp_path / "leases.json").exists()
    first.stop()
    started.remove(first)
    second = start(started, data_dir=str(tmp_path), durability="none")
    with KVCoordClient(second.address, retry=NO_RETRY) as c, pytest.raises(GracePeriodError):
        c.attach("p", "sha256_cbor", 4, "0")


def test_idempotency_keys_are_scoped_and_bound(started: list[InProcessServer]) -> None:
    """The same key with another body is refused; another session's key never returns
    someone else's answer; the same request is answered once."""
    server = start(started)
    with KVCoordClient(server.address) as c:
        s1 = c.attach("p", "sha256_cbor", 4, "0").session_id
        s2 = c.attach("p", "sha256_cbor", 4, "0").session_id
        op = allocate_op(pb.RequestSync(request_id="a", append_token_ids=[1, 2, 3], new_request=True), 3)
        req = pb.StepRequest(pool="p", session_id=s1, ops=[pb.Operation(allocate=op)], idempotency_key="k")
        first = c._call("Step", req)
        assert c._call("Step", req) == first  # a retry is answered, not applied again
        assert held(c)["a"] == [list(g.block_ids) for g in first.results[0].allocate.new_block_ids]
        other = pb.StepRequest()
        other.CopyFrom(req)
        other.ops[0].allocate.request.request_id = "b"
        with pytest.raises(KeyReusedError):
            c._call("Step", other)
        free = pb.FreeRequest(pool="p", session_id=s1, request_ids=["a"], idempotency_key="k")
        with pytest.raises(KeyReusedError):
            c._call("Free", free)
        assert "a" in held(c)  # the refused Free freed nothing
        other.session_id = s2
        answer = c._call("Step", other)  # s2's "k" is its own key
        assert answer.results[0].status_code == 0 and set(held(c)) == {"a", "b"}


def test_event_streams_flag_gaps_and_resets(started: list[InProcessServer]) -> None:
    """A slow subscriber is told of every gap; a resume against another pool
    incarnation starts over with reset = true."""
    from kvcoord.service.registry import Limits

    server = start(started, limits=Limits(event_buffer=4))
    with KVCoordClient(server.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        fence = m.keeper.fence
        for i in range(3):
            m.allocate_slots(Req(f"a{i}", list(range(i * 40, i * 40 + 8))), 8)
            m.cache_blocks(Req(f"a{i}", list(range(i * 40, i * 40 + 8)), 8), 8)
        stream = c.watch_events("p", 0, timeout=2)
        first = next(stream)
        # the pool keeps 4 events: a fresh watcher is told of those before its first
        assert first.gap is (first.sequence > 1) and first.fence == fence
        stream.close()
        for i in range(3, 6):  # more events than the pool keeps: the subscriber misses some
            m.allocate_slots(Req(f"a{i}", list(range(i * 40, i * 40 + 8))), 8)
            m.cache_blocks(Req(f"a{i}", list(range(i * 40, i * 40 + 8)), 8), 8)
        resumed_stream = c.watch_events("p", first.sequence, timeout=2, fence=fence)
        second = next(resumed_stream)
        assert second.gap is True and second.sequence > first.sequence + 1
        third = next(resumed_stream)
        assert third.gap is False and third.sequence == second.sequence + 1
        resumed_stream.close()
        m.close()
        old = pb.Fence()
        old.CopyFrom(fence)
        cfg = c.get_pool("p").pool.config
        c.delete_pool("p")
        c.create_pool("p", cfg)
        m2 = RemoteKVCacheManager(c, "p", hash_seed="0")
        m2.allocate_slots(Req("z", list(range(8))), 8)
        m2.cache_blocks(Req("z", list(range(8)), 8), 8)
        resumed = next(c.watch_events("p", second.sequence, timeout=2, fence=old))
        assert resumed.reset is True and resumed.sequence == 1 and resumed.gap is False
        assert resumed.fence.incarnation != old.incarnation
        m2.close()


def test_take_events_has_a_cursor_per_session(started: list[InProcessServer]) -> None:
    """Two workers on one pool each take every event once: one worker's take does not
    consume the other's."""
    server = start(started)
    with KVCoordClient(server.address) as c:
        a = RemoteKVCacheManager(c, "p", hash_seed="0")
        b = RemoteKVCacheManager(c, "p", hash_seed="0")
        a.allocate_slots(Req("x", list(range(8))), 8)
        a.cache_blocks(Req("x", list(range(8)), 8), 8)
        ea, eb = a.take_events(), b.take_events()
        assert ea and [e.SerializeToString() for e in ea] == [e.SerializeToString() for e in eb]
        assert a.take_events() == [] and b.take_events() == []


def test_undecodable_and_huge_inputs_get_clear_bounded_errors(
    started: list[InProcessServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that are no message are INVALID_ARGUMENT, with nothing logged at error level
    (no traceback per request); an error about a 70,000-character input stays small
    (never RESOURCE_EXHAUSTED)."""
    server = start(started)
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.address) as ch:
        raw = ch.unary_unary(
            "/kvcoord.v1.Allocator/Step", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff", timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid kvcoord.v1.StepRequest" in err.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    with KVCoordClient(server.address) as c:
        with pytest.raises(Exception) as big:
            c.get_pool("x" * 70_000)
        # a name past its input bound (docs/input-bounds.md), named in a short message
        assert "INVALID_ARGUMENT: name is 70,000 characters long" in str(big.value)
        assert len(str(big.value)) < 1200


def test_empty_prompt_is_refused_and_stats_stay_sound(started: list[InProcessServer]) -> None:
    """An empty prompt on a hybrid pool is INVALID_ARGUMENT with nothing changed; the
    pool's statistics stay readable and unchanged (they once went negative)."""
    server = start(started)
    with KVCoordClient(server.address) as c:
        s = c.attach("p", "sha256_cbor", 4, "0")

        def pool_stats() -> pb.GetStatsResponse:
            stats = c.get_stats("p")
            stats.ClearField("limits")  # server-wide: the idempotency store counts the keyed Step
            return stats

        before = pool_stats()
        lookup = pb.Operation(lookup=pb.LookupOp(request=pb.RequestSync(request_id="e", new_request=True)))
        resp = c.step("p", [lookup], s.session_id, s.fence)
        assert resp.results[0].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert pool_stats() == before and held(c) == {}
        with pytest.raises(InvalidArgumentError):
            c.find_longest_cache_hit("p", [], 0)  # a degenerate read-only lookup, refused too
        assert pool_stats() == before


def test_exclusive_worker_back_from_a_partition_takes_its_pool_again(started: list[InProcessServer]) -> None:
    """A worker that gave up on its lease during a partition reports its requests lost;
    once reachable it ends the old session (still alive on the server) and attaches
    exclusively again at once, instead of being refused until the old lease ends."""
    clock = ManualClock()  # the server's clock does not move: the old session stays alive
    server = start(started, clock=clock, session_lease_seconds=0.5, max_session_lease_seconds=0.5,
                   idempotency_window_seconds=300.0)  # fmt: skip
    fi = FaultInjector(2)
    with KVCoordClient(server.address, interceptors=[fi], retry=NO_RETRY) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False, exclusive=True)
        old = m.session_id
        assert m.allocate_slots(Req("a", list(range(8))), 8) is not None
        m.flush()
        fi.partitioned = True
        time.sleep(0.6)
        with pytest.raises(RequestsLostError) as lost:
            m.allocate_slots(Req("b", list(range(8))), 8)
        assert "a" in lost.value.request_ids
        fi.partitioned = False
        assert m.allocate_slots(Req("c", list(range(8))), 8) is not None
        m.flush()
        assert m.session_id != old and set(held(c)) == {"c"}  # "a" freed with the old session


@pytest.mark.parametrize("path", ["take_events", "usage"])
def test_a_lost_session_is_never_swallowed(started: list[InProcessServer], path: str) -> None:
    """Calls nobody waits for (take_events, usage after queued calls) raise the loss of
    the session, and a request reported lost cannot be used as if it held blocks: it
    must be reset (preempted) first. (Before, the loss went unreported and the next
    allocate registered the request afresh: a second table handed out as new blocks.)"""
    clock = ManualClock()
    server = start(started, clock=clock)
    with KVCoordClient(server.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False)
        a = Req("a", list(range(16)))
        assert m.allocate_slots(a, 16) is not None
        a.num_computed_tokens = 16
        if path == "usage":
            m.cache_blocks(a, 16)  # something queued, so usage has to send it
        clock.advance(31)
        server.call(server.running.servicer.reap_expired_sessions)  # type: ignore[union-attr]
        with pytest.raises(RequestsLostError) as lost:
            _ = m.take_events() if path == "take_events" else m.usage
        assert lost.value.request_ids == ["a"]
        a.all_token_ids.append(99)
        with pytest.raises(RequestsLostError):
            m.allocate_slots(a, 1)  # still "running" in the scheduler: refused, loudly
        assert held(c) == {}
        a.num_computed_tokens = 0  # the scheduler preempts it: a fresh start is fine
        assert m.allocate_slots(a, len(a.all_token_ids)) is not None


def test_a_failed_admit_keeps_nothing_of_the_failing_request(started: list[InProcessServer]) -> None:
    """An admission that meets an invalid request stops before it: the admitted ones
    stand (client and server agree), the bad one fails on its own next time."""
    server = start(started)
    with KVCoordClient(server.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", exclusive=True)
        good, bad = Req("r1", list(range(8))), Req("r2", list(range(300)))  # 300 > max_model_len
        out = m.admit([good, bad], 1000)
        assert len(out) == 1 and out[0][3] is not None
        assert set(held(c)) == {"r1"}
        good.num_computed_tokens = 8
        assert m.allocate_slots(good, 1) is not None  # positions agree: no SYNC_MISMATCH
        m.flush()
        with pytest.raises(InvalidArgumentError):
            m.admit([bad], 1000)
        assert set(held(c)) == {"r1"}


def test_a_failed_allocate_that_changed_the_pool_is_journaled(
    started: list[InProcessServer], tmp_path: Path
) -> None:
    """A must_succeed refusal still removes sliding-window blocks (as vLLM's refusals
    do) and fails: the journal has it, so a restart recovers exactly that state (before,
    the recovered pool gave the freed blocks back to the old request)."""

    pool = POOL.replace("enable_caching = true", "enable_caching = false")

    def tables(c: KVCoordClient) -> object:
        r = c.inspect_pool("p", all_requests=True, free_queue_limit=64)
        return {x.request_id: [list(g.block_ids) for g in x.groups] for x in r.requests}, list(
            r.free_queue_head
        )

    port = free_port()  # (restarted on it: none from the ephemeral range, see tests/ports.py)
    first = InProcessServer(pool, data_dir=str(tmp_path), durability="journal", port=port).start()
    started.append(first)
    with KVCoordClient(first.address) as c:
        att = c.attach("p", "sha256_cbor", 4, "0")
        sid, fence = att.session_id, att.fence

        def alloc(rid: str, n: int) -> None:
            sync = pb.RequestSync(request_id=rid, append_token_ids=list(range(n)), new_request=True)
            c.allocate("p", allocate_op(sync, n), sid, fence)

        alloc("a", 20)
        alloc("f", 96)
        sync = pb.RequestSync(request_id="a", base_num_tokens=20, append_token_ids=list(range(20, 60)),
                              num_computed_tokens=20)  # fmt: skip
        op = allocate_op(sync, 40)
        op.must_succeed = True
        with pytest.raises(Exception, match="PREDICTION_FAILED|refused an allocation"):
            c.allocate("p", op, sid, fence)
        alloc("g", 12)
        live = tables(c)
    first.stop()
    started.remove(first)
    second = InProcessServer(pool, data_dir=str(tmp_path), durability="journal", port=port).start()
    started.append(second)
    with KVCoordClient(second.address) as c:
        assert tables(c) == live


def test_one_server_per_data_directory(started: list[InProcessServer], tmp_path: Path) -> None:
    """In one process too, a second server on a data directory a running server holds
    does not start (DataDirInUseError, before it reads anything there) and the first
    serves on; the first's stop gives the directory back, and the next server recovers
    its state."""
    first = start(started, data_dir=str(tmp_path), durability="journal")
    with KVCoordClient(first.address) as c:
        att = c.attach("p", "sha256_cbor", 4, "0")
        sync = pb.RequestSync(request_id="a", append_token_ids=[1, 2, 3], new_request=True)  # (no full block)
        c.allocate("p", allocate_op(sync, 3), att.session_id, att.fence)
    second = InProcessServer(POOL, data_dir=str(tmp_path), durability="journal")
    try:
        with pytest.raises(
            DataDirInUseError, match=f"data directory {tmp_path} is in use by another kvcoord"
        ):
            second.start()
    finally:
        second.stop()
    with KVCoordClient(first.address) as c:
        assert [r.request_id for r in c.inspect_pool("p", all_requests=True).requests] == ["a"]
    first.stop()
    started.remove(first)
    third = start(started, data_dir=str(tmp_path), durability="journal")
    with KVCoordClient(third.address) as c:
        assert [r.request_id for r in c.inspect_pool("p", all_requests=True).requests] == ["a"]


@pytest.mark.parametrize("fault", ["refused", "answer lost"])
def test_a_failed_step_loses_no_free_and_no_request_silently(
    started: list[InProcessServer], fault: str
) -> None:
    """A Step carrying a queued free and an allocation fails: it never reached the
    server (refused), or the server applied it and the answer was lost. Either way its
    outcome is unknown to the client, so the allocation's request is reported lost, and
    the free happens: at once, or, while the server cannot be reached, with the next
    Step. Nothing is left held."""
    server = start(started)
    fi = FaultInjector(3, methods=("Step", "Free"))
    with KVCoordClient(server.address, interceptors=[fi], retry=NO_RETRY) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", exclusive=True)
        a, b = Req("a", list(range(20))), Req("b", list(range(100, 106)))
        for r in (a, b):
            assert m.allocate_slots(r, len(r.all_token_ids)) is not None
            r.num_computed_tokens = len(r.all_token_ids)
        m.flush()
        m.free(a)  # queued
        b.all_token_ids.append(7)
        if fault == "refused":
            fi.partitioned = True
        else:
            fi.p = (1.0, 0.0, 0.0, 0.0)  # every answer dropped
        with pytest.raises(RequestsLostError) as lost:
            m.allocate_slots(b, 1)  # sent with the queued free; its outcome is unknown
        assert lost.value.request_ids == ["b"]
        fi.partitioned, fi.p = False, (0.0, 0.0, 0.0, 0.0)
        m.flush()  # what could not be sent goes now
        assert "a" not in held(c)
        m.free(b)
        m.flush()
        assert held(c) == {} and c.get_stats("p").num_free_blocks == 63


def test_a_refused_registration_leaves_nothing_of_its_prompt(started: list[InProcessServer]) -> None:
    """A registration the pool refuses (another session holds the id) leaves nothing
    of its prompt in the client: when the id is used again for another prompt, the
    blocks are cached under that prompt's own hashes, and a request with the refused
    prompt gets no hit on them. (Before, the refused prompt stayed in the request's
    hasher, the new prompt's blocks were cached under the old prompt's hashes, and
    another worker adopted them as a prefix hit: KV of other tokens.)"""
    server = start(started)
    with KVCoordClient(server.address) as c:
        a = RemoteKVCacheManager(c, "p", hash_seed="0", client_name="A")
        b = RemoteKVCacheManager(c, "p", hash_seed="0", client_name="B")
        theirs = Req("x", [7] * 9)
        b.get_computed_blocks(theirs)  # B holds the id "x"
        old_prompt = list(range(1, 10))
        with pytest.raises(PermissionDeniedError):
            a.get_computed_blocks(Req("x", old_prompt))  # refused: nothing registered
        b.free(theirs)
        b.flush()
        new_prompt = list(range(100, 113))
        x = Req("x", new_prompt)  # A's next request happens to take the id "x"
        hit, n = a.get_computed_blocks(x)
        assert a.allocate_slots(x, len(new_prompt) - n, n, hit) is not None
        x.num_computed_tokens = len(new_prompt)
        truth = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(new_prompt)
        assert [bytes(h) for h in a.tracker.hashes(x)] == truth
        a.free(x)
        a.flush()
        _, victim_tokens = b.get_computed_blocks(Req("v", [*old_prompt, 0, 0, 0, 0]))
        assert victim_tokens == 0


def test_a_batch_left_by_an_exception_moves_back_only_its_own_requests(
    started: list[InProcessServer],
) -> None:
    """An exception inside ``with manager.batch()`` drops the batch's calls and moves
    back only the requests they synced: a queued cache_blocks of another request is
    sent as it was built, and that request goes on. (Before, every tracked request was
    moved back, the queued call then mismatched the server, and the request was
    reported lost.)"""
    server = start(started)
    with KVCoordClient(server.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        r = Req("r", list(range(8)))
        assert m.allocate_slots(r, 8) is not None
        r.num_computed_tokens = 8
        r.all_token_ids.append(99)
        m.cache_blocks(r, 8)  # queued: its sync appends token 99
        with pytest.raises(ValueError), m.batch() as b:
            looked_up = b.get_computed_blocks(Req("other", list(range(40, 50))))
            raise ValueError("an exception later in the scheduler step")
        assert m.allocate_slots(r, 1) is not None  # not lost
        assert m.lost_requests == 0 and set(held(c)) == {"r"}
        assert "other" not in m.tracker
        with pytest.raises(AbortedError):
            looked_up.result()
        assert c.check_pool("p").violations == []


def test_a_batch_left_by_an_exception_still_frees(started: list[InProcessServer]) -> None:
    """A free collected in a batch that is left by an exception is still sent (with
    the manager's next Step): the request it forgot leaves the pool. (Before, the
    request was forgotten by the client and held by the server for the session's
    life.)"""
    server = start(started)
    with KVCoordClient(server.address) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        r = Req("r", list(range(8)))
        assert m.allocate_slots(r, 8) is not None
        with pytest.raises(ValueError), m.batch() as b:
            b.free(r)
            raise ValueError("an exception later in the scheduler step")
        m.flush()
        assert "r" not in m.tracker and held(c) == {}


def test_a_free_sent_again_leaves_another_sessions_request_alone(started: list[InProcessServer]) -> None:
    """A worker cut off while registering "x" frees it again once reachable; by then
    another worker's request holds the id "x". The free sent again means "free it if I
    still hold it": it leaves the other request alone and the worker's later Steps
    succeed. (Before, it was refused with PERMISSION_DENIED and sent again with every
    Step, each of which failed until the other worker freed its "x".)"""
    server = start(started)
    fi = FaultInjector(4, methods=("Step", "Free"))
    retry = RetryPolicy(initial_backoff=0.001, max_backoff=0.002, max_attempts=2, deadline=2.0)
    with (
        KVCoordClient(server.address, interceptors=[fi], retry=retry) as ca,
        KVCoordClient(server.address) as cb,
    ):
        a = RemoteKVCacheManager(ca, "p", hash_seed="0", client_name="A", renew=False)
        b = RemoteKVCacheManager(cb, "p", hash_seed="0", client_name="B")
        fi.partitioned = True
        with pytest.raises(RequestsLostError):
            a.get_computed_blocks(Req("x", list(range(9))))
        fi.partitioned = False
        theirs = Req("x", list(range(50, 59)))
        assert b.allocate_slots(theirs, 9) is not None
        table = held(cb)["x"]
        for i in range(3):
            r = Req(f"a{i}", list(range(200 + 20 * i, 209 + 20 * i)))
            assert a.allocate_slots(r, 9) is not None
        assert held(cb)["x"] == table and {"a0", "a1", "a2"} <= set(held(cb))
        assert cb.check_pool("p").violations == []
