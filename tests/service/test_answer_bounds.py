"""Answers are bounded before the change is committed (issue 26, scenario 5 and "done"
item 4): over real gRPC, with a small max_message_bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored
from kvcoord.service.events import event_wire_bytes
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from kvcoord.wire import event_to_pb
from test_streams import pool16

LIMIT = 64 * 1024

POOL = pool16("big", 4096)


def _store(client: KVCoordClient, sid: str, fence: pb.Fence, i: int, tokens: int = 800) -> None:
    """A fresh prompt cached and freed (tokens / 16 blocks stay cached)."""
    prompt = [100_000 + i * tokens + t for t in range(tokens)]
    ops = [allocate(f"w{i}", prompt, tokens, block_size=16), pb.Operation(free=pb.FreeOp(request_id=f"w{i}"))]
    response = client.step("big", ops, sid, fence)
    assert [r.status_code for r in response.results] == [0, 0]


@pytest.fixture
def small(make_server: Callable[..., InProcessServer], tmp_path: Path) -> InProcessServer:
    """A journaled server with a 64 KiB max_message_bytes."""
    return make_server(POOL, max_message_bytes=LIMIT, data_dir=str(tmp_path / "data"))


def test_an_idle_workers_events_arrive_over_several_bounded_answers(small: InProcessServer) -> None:
    """A worker idles while another stores ~200 KB of events; its next Step with
    include_state (and another's TakeEventsOp) is answered below max_message_bytes
    with events_more (old code: RESOURCE_EXHAUSTED for a Step that was applied and
    journaled, its events lost), and the following calls deliver the rest, in order,
    nothing lost or repeated: exactly the pool's events."""
    with KVCoordClient(small.address, timeout=10) as client:
        idle, idle_fence = attach(client, "big", block_size=16)
        taker, taker_fence = attach(client, "big", block_size=16)
        busy, busy_fence = attach(client, "big", block_size=16)
        for i in range(48):
            _store(client, busy, busy_fence, i)
        journal = small.running.servicer.registry.pools["big"].events  # type: ignore[union-attr]
        want = [event_to_pb(e) for _, e in small.call(journal.kept)]
        assert sum(e.ByteSize() for e in want) > 2 * LIMIT

        got: list[pb.KVEvent] = []
        answers = 0
        while True:
            response = client.step("big", [], idle, idle_fence, include_state=True)
            answers += 1
            assert response.ByteSize() <= LIMIT and not response.events_gap
            got.extend(response.events)
            if not response.events_more:
                break
            assert len(response.events) > 0 and answers < 100
        assert answers > 2
        assert got == want

        got = []
        answers = 0
        while True:
            response = client.step("big", [pb.Operation(take_events=pb.TakeEventsOp())], taker, taker_fence)
            answers += 1
            taken = response.results[0].take_events
            assert response.ByteSize() <= LIMIT and not taken.gap
            got.extend(taken.events)
            if not taken.more:
                break
            assert answers < 100
        assert answers > 2
        assert got == want


def test_an_exclusive_attach_whose_state_cannot_fit_leaves_no_session(small: InProcessServer) -> None:
    """An exclusive Attach with want_pool_state on a pool whose state is larger than
    one answer is refused with ANSWER_TOO_LARGE naming the size, before any session
    exists: a second exclusive Attach succeeds at once (old code: the session was made,
    its answer could not be sent, and it locked the pool for its lease)."""
    with KVCoordClient(small.address, timeout=10) as client:
        sid, fence = attach(client, "big", block_size=16)
        for i in range(48):  # 2400 cached blocks: ~90 KB of hashes and ids
            _store(client, sid, fence, i)
        client.detach(sid, fence)
    stub = pb_grpc.AllocatorStub(grpc.insecure_channel(small.address))
    request = pb.AttachRequest(
        pool="big",
        hash_algo="sha256_cbor",
        hash_block_size=16,
        hash_seed="0",
        exclusive=True,
        want_pool_state=True,
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.Attach(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    sessions = small.running.servicer.registry.sessions  # type: ignore[union-attr]
    assert small.call(lambda: len(sessions.sessions)) == 0
    request.want_pool_state = False
    second = stub.Attach(request, timeout=10)
    assert second.exclusive and second.session_id
    assert "max_message_bytes 65,536" in refused.value.details()
    assert ("kvcoord-reason", "ANSWER_TOO_LARGE") in (refused.value.trailing_metadata() or ())


def test_the_wire_estimate_of_an_event_is_an_upper_bound() -> None:
    """event_wire_bytes (what answers are cut by) is at least what an event takes as
    a repeated field of an answer, for every kind of event and the largest values."""
    h = b"h" * 32
    events = [
        BlockStored((h,) * 16, h, tuple(range(2**32 - 1024, 2**32)), 16, 2**32 - 1, "lora-ä" * 10),
        BlockStored((h,), None, (0,) * 16, 16, None, None),
        BlockStored((h, h), h, tuple(range(300, 332)), 16, 7, "a", "CPU"),
        BlockRemoved((h,) * 100),
        BlockRemoved((h,), "CPU"),
        AllBlocksCleared(),
    ]
    for e in events:
        answer = pb.StepResponse()
        answer.events.append(event_to_pb(e))
        assert answer.ByteSize() <= event_wire_bytes(e), e


def test_a_cut_take_is_reproduced_by_its_count() -> None:
    """PoolService.take_events cut at a byte budget leaves the cursor after the last
    event given (the next take continues, nothing lost or repeated); the same take
    on an identical pool cut by the number of events it gave (what a replay of the
    journaled answer knows) leaves the cursor at the same place."""
    from kvcoord.engine import FullAttentionSpec, KVCacheConfig
    from kvcoord.service import operations as op
    from kvcoord.service.pool_service import Fence, Limits, PoolService
    from kvcoord.service.sessions import SessionTable
    from kvcoord.service.testing import ManualClock

    def pool() -> tuple[PoolService, object]:
        cfg = KVCacheConfig(
            num_blocks=256, groups=(FullAttentionSpec(16),), hash_block_size=16, enable_kv_cache_events=True
        )
        p = PoolService(
            "p", cfg, ("sha256_cbor", 16, "0"), Fence("i", 1), Limits(), SessionTable(ManualClock(), 30, 60)
        )
        reader = p.attach("sha256_cbor", 16, "0", "reader", 0)
        writer = p.attach("sha256_cbor", 16, "0", "writer", 0)
        for i in range(12):
            prompt = [i * 160 + t for t in range(160)]
            sync = op.RequestSync(f"r{i}", prompt, salted16(prompt), new_request=True)
            assert [o.error for o in p.apply(writer, [op.Allocate(sync, 160), op.Free(f"r{i}")])] == [
                None,
                None,
            ]
        return p, reader

    p, reader = pool()
    everything = [e for _, e in p.events.kept()]
    first = p.take_events(reader, max_bytes=3000)
    assert first.more and not first.gap and 0 < len(first.events) < len(everything)
    stopped_at = reader.events_cursor
    rest = p.take_events(reader, max_bytes=1 << 20)
    assert not rest.more and first.events + rest.events == everything
    again, reader_again = pool()
    replayed = again.take_events(reader_again, max_events=len(first.events))
    assert replayed.more and replayed.events == first.events
    assert reader_again.events_cursor == stopped_at


def salted16(tokens: list[int]) -> list[bytes]:
    from kvcoord.client.hashing import BlockHasher, none_hash

    return BlockHasher("sha256_cbor", 16, none_hash("sha256_cbor", "0")).extend(tokens)


def test_the_remote_manager_takes_every_event_across_cut_answers(small: InProcessServer) -> None:
    """RemoteKVCacheManager.take_events (vLLM's take_events) returns every event since
    its previous call, fetching what the server cut from answers (events_more)."""
    from kvcoord.client import RemoteKVCacheManager

    with KVCoordClient(small.address, timeout=10) as client:
        manager = RemoteKVCacheManager(client, "big", hash_seed="0")
        manager.take_events()
        busy, busy_fence = attach(client, "big", block_size=16)
        journal = small.running.servicer.registry.pools["big"].events  # type: ignore[union-attr]
        start = small.call(lambda: journal.last_sequence)
        for i in range(48):
            _store(client, busy, busy_fence, i)
        want = [event_to_pb(e) for seq, e in small.call(journal.kept) if seq > start]
        assert sum(e.ByteSize() for e in want) > 2 * LIMIT
        assert manager.take_events() == want
        manager.close()


def test_a_predicting_manager_on_a_pool_too_large_to_send_is_refused_cleanly(small: InProcessServer) -> None:
    """PredictingKVCacheManager asks for the pool's state: on a pool whose state cannot
    fit in one answer it gets ResourceExhaustedError with reason ANSWER_TOO_LARGE (what
    the vLLM adapter falls back on, running without prediction) and no session is left
    behind: a RemoteKVCacheManager attaches exclusively at once."""
    from kvcoord.client import PredictingKVCacheManager, RemoteKVCacheManager
    from kvcoord.client.errors import ResourceExhaustedError

    with KVCoordClient(small.address, timeout=10) as client:
        sid, fence = attach(client, "big", block_size=16)
        for i in range(48):
            _store(client, sid, fence, i)
        client.detach(sid, fence)
        with pytest.raises(ResourceExhaustedError) as refused:
            PredictingKVCacheManager(client, "big", hash_seed="0")
        assert refused.value.reason == "ANSWER_TOO_LARGE"
        manager = RemoteKVCacheManager(client, "big", hash_seed="0", exclusive=True)
        assert manager.keeper.exclusive and manager.keeper.session_id
        manager.close()
