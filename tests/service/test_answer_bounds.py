"""Answers are bounded before the change is committed (issue 26, scenario 5 and "done"
item 4): over real gRPC, with a small max_message_bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.client.hashing import block_hasher, none_hash
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
    a repeated field of an answer, for every kind of event and the largest values,
    vllm-0.33's fields included."""
    h = b"h" * 32
    events = [
        BlockStored((h,) * 16, h, tuple(range(2**32 - 1024, 2**32)), 16, 2**32 - 1, "lora-ä" * 10),
        BlockStored((h,), None, (0,) * 16, 16, None, None),
        BlockStored((h, h), h, tuple(range(300, 332)), 16, 7, "a", "CPU"),
        BlockRemoved((h,) * 100),
        BlockRemoved((h,), "CPU"),
        AllBlocksCleared(),
        # vllm-0.33's fields: each block's extra keys (a LoRA name, multimodal keys, a
        # cache salt, a prompt-embeds digest), the group, the spec, look-ahead tokens
        # (old estimate: without them, 795 bytes for the first one's 983)
        BlockStored(
            (h,) * 4,
            h,
            (2**32 - 1,) * 64,
            16,
            2**32 - 1,
            "lora-ä" * 10,
            "GPU",
            b"",
            (("lora-ä" * 10, ("ä" * 64, -(2**63)), "salt-ä"), ("lora", h), None, ()),
            2**32 - 1,
            "sliding_window_ä",
            2**32 - 1,
            ((2**32 - 1,) * 3,) * 4,
        ),
        BlockStored((h,), None, (0,) * 16, 16, None, None, "GPU", b"", (None,), 0, "full_attention"),
        BlockRemoved((h,) * 3, "GPU", b"", 2**32 - 1),
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


def _reads_step(sid: str, fence: pb.Fence, key: str) -> pb.StepRequest:
    """A ~9 kB Step whose answer is ~150 kB: request x allocated (50 blocks), then its
    block table read 1,400 times (a buggy worker's Step)."""
    ops = [allocate("x", list(range(800)), 800, block_size=16)]
    ops += [pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="x"))] * 1400
    return pb.StepRequest(pool="big", session_id=sid, fence=fence, ops=ops, idempotency_key=key)


def _refused(address: str, request: pb.StepRequest, how: str) -> grpc.RpcError:
    """``request`` sent as a unary Step or as a StepStream's message: its error."""
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.AllocatorStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            if how == "unary":
                stub.Step(request, timeout=10)
            else:
                list(stub.StepStream(iter([request]), timeout=10))
    return refused.value


@pytest.mark.parametrize("first", ["unary", "stream"])
@pytest.mark.parametrize("snapshot", [False, True])
def test_a_step_whose_answer_cannot_be_sent_says_it_was_applied(
    make_server: Callable[..., InProcessServer], tmp_path: Path, first: str, snapshot: bool
) -> None:
    """A Step whose answer is larger than max_message_bytes is applied before its size is
    known (block tables decide it): it is told ABORTED with reason ANSWER_EVICTED
    ("applied: treat its requests as lost"), and a retry under its key gets the same,
    over the other path (unary or StepStream) and after a restart, from the journal
    alone or from a snapshot; it is never applied twice. Old code: RESOURCE_EXHAUSTED
    without a reason ("nothing changed", per the proto) while the pool held x; after a
    journal replay the full answer was kept under the key again."""
    data = str(tmp_path / "data")
    server = make_server(POOL, max_message_bytes=LIMIT, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as client:
        sid, fence = attach(client, "big", block_size=16)
        free_before = client.get_stats("big").num_free_blocks
    request = _reads_step(sid, fence, "k1")
    assert request.ByteSize() < LIMIT // 4

    def check(address: str, how: str) -> str:
        err = _refused(address, request, how)
        assert err.code() == grpc.StatusCode.ABORTED, (err.code(), err.details())
        assert ("kvcoord-reason", "ANSWER_EVICTED") in (err.trailing_metadata() or ())
        with KVCoordClient(address, timeout=10) as client:
            held = client.inspect_pool("big", all_requests=True).requests
            assert [(r.request_id, len(r.groups[0].block_ids)) for r in held] == [("x", 50)]
            assert client.get_stats("big").num_free_blocks == free_before - 50
        return str(err.details())

    assert "is larger than max_message_bytes (65,536)" in check(server.address, first)
    check(server.address, "stream" if first == "unary" else "unary")
    server.stop(snapshot=snapshot)
    again = make_server(POOL, max_message_bytes=LIMIT, data_dir=data)
    check(again.address, first)


@pytest.mark.parametrize("step_stream", [True, False])
def test_the_manager_reports_the_requests_of_an_unsendable_answer_lost(
    small: InProcessServer, step_stream: bool
) -> None:
    """RemoteKVCacheManager, one batch whose answer cannot be sent (ANSWER_EVICTED): every
    call of it raises RequestsLostError, the request is freed on the server (it holds
    nothing, every block back), and once the scheduler resets it the request is
    allocated afresh."""
    from kvcoord.client import RemoteKVCacheManager, RequestsLostError
    from support import Req

    with KVCoordClient(small.address, timeout=10, step_stream=step_stream) as client:
        manager = RemoteKVCacheManager(client, "big", hash_seed="0")
        free_before = client.get_stats("big").num_free_blocks
        x = Req("x", list(range(800)))
        with manager.batch() as batch:
            pending = [batch.allocate_slots(x, 800)]
            pending += [batch.get_block_ids("x") for _ in range(1400)]
        for p in pending[:2]:
            with pytest.raises(RequestsLostError) as lost:
                p.result()
            assert lost.value.request_ids == ["x"] and lost.value.reason == "ANSWER_EVICTED"
        assert list(client.inspect_pool("big", all_requests=True).requests) == []
        assert client.get_stats("big").num_free_blocks == free_before
        blocks = manager.allocate_slots(x, 800)
        assert blocks is not None and len(blocks.get_block_ids()[0]) == 50
        manager.close()


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_kept_answer_larger_than_a_lowered_limit_says_it_was_applied(
    make_server: Callable[..., InProcessServer], tmp_path: Path, snapshot: bool
) -> None:
    """A Step answered (its answer kept under its key) by a server with a larger
    max_message_bytes; the server restarts with a smaller one (a config change in a
    rolling restart) and the client, whose answer was lost, retries under the same key.
    The kept answer no longer fits: the retry is told ABORTED ANSWER_EVICTED ("applied"),
    as one too large when applied is. Old code: RESOURCE_EXHAUSTED without a reason
    ("nothing changed") while the pool still held x's blocks."""
    small, large = 64 * 1024, 1024 * 1024
    data = str(tmp_path / "data")
    server = make_server(POOL, max_message_bytes=large, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as client:
        sid, fence = attach(client, "big", block_size=16)
    request = _reads_step(sid, fence, "k1")
    with grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        answer = pb_grpc.AllocatorStub(ch).Step(request, timeout=10)  # (the answer the client lost)
    assert small < answer.ByteSize() <= large
    server.stop(snapshot=snapshot)
    again = make_server(POOL, max_message_bytes=small, data_dir=data)
    with KVCoordClient(again.address, timeout=10) as client:
        held = client.inspect_pool("big", all_requests=True).requests
        assert [(r.request_id, len(r.groups[0].block_ids)) for r in held] == [("x", 50)]
    err = _refused(again.address, request, "unary")
    assert err.code() == grpc.StatusCode.ABORTED, (err.code(), err.details())
    assert ("kvcoord-reason", "ANSWER_EVICTED") in (err.trailing_metadata() or ())


#: a vllm-0.33 pool of 16-token blocks with events: its BlockStored events carry 0.33's
#: fields (each block's extra keys, the group, the spec's kind)
POOL_033 = POOL.replace('name = "big"', 'name = "big33"\nprofile = "vllm-0.33"')
#: a LoRA adapter name at the longest a request may give (every block's extra keys name it)
LONG_LORA = "adapter-" + "x" * 248


def test_a_033_pools_events_with_extra_keys_arrive_over_bounded_answers(
    make_server: Callable[..., InProcessServer], tmp_path: Path
) -> None:
    """A vllm-0.33 pool publishes each block's extra keys in BlockStored (a LoRA
    request's: the adapter's name on every block): an idle worker's Step with
    include_state is still answered below max_message_bytes, over several answers,
    every event once (old code: the answer was cut by an estimate that left out 0.33's
    fields, came out larger than max_message_bytes, and the Step, applied, was told
    ABORTED ANSWER_EVICTED: its worker was to treat its requests as lost)."""
    server = make_server(POOL_033, max_message_bytes=LIMIT, data_dir=str(tmp_path / "data"))
    with KVCoordClient(server.address, timeout=10) as client:
        idle = client.attach("big33", "sha256_cbor", 16, "0", profile="vllm-0.33")
        busy = client.attach("big33", "sha256_cbor", 16, "0", profile="vllm-0.33")
        none = none_hash("sha256_cbor", "0", profile="vllm-0.33")
        for i in range(12):
            prompt = [100_000 + i * 800 + t for t in range(800)]
            hasher = block_hasher("vllm-0.33", "sha256_cbor", 16, none, lora_name=LONG_LORA, lora_path="/a")
            sync = pb.RequestSync(
                request_id=f"w{i}",
                append_token_ids=prompt,
                append_block_hashes=hasher.extend(prompt),
                new_request=True,
                lora=pb.LoRA(adapter_id=1, name=LONG_LORA),
            )
            ops = [
                pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=len(prompt))),
                pb.Operation(free=pb.FreeOp(request_id=f"w{i}")),
            ]
            response = client.step("big33", ops, busy.session_id, busy.fence)
            assert [r.status_code for r in response.results] == [0, 0]
        journal = server.running.servicer.registry.pools["big33"].events  # type: ignore[union-attr]
        want = [event_to_pb(e) for _, e in server.call(journal.kept)]
        assert sum(e.ByteSize() for e in want) > 2 * LIMIT
        assert all(len(e.block_stored.extra_keys) == len(e.block_stored.block_hashes) for e in want)

        got: list[pb.KVEvent] = []
        for _ in range(100):
            response = client.step("big33", [], idle.session_id, idle.fence, include_state=True)
            assert response.ByteSize() <= LIMIT and not response.events_gap
            got.extend(response.events)
            if not response.events_more:
                break
        assert got == want
