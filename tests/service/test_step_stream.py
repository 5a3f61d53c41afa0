"""StepStream (issue 23 item 3): each message is exactly a unary Step, over real gRPC.

The reference answers are the unary Step's, recorded in the same test from a second
server given the same Steps; a Step that fails ends the stream with its unary status.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.client import _requests as rq
from kvcoord.client.errors import error_from_rpc
from kvcoord.service.session_calls import CAPABILITIES
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from support import scrape_metrics

#: a deadline for calls that answer at once on a sound server
ANSWER_WITHIN = 10.0


class Stream:
    """A raw StepStream: requests put one at a time, answers read one at a time."""

    _END = object()

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue[Any] = queue.Queue()
        self.call = pb_grpc.AllocatorStub(self.channel).StepStream(self._feed(), timeout=60)

    def _feed(self) -> Iterator[pb.StepRequest]:
        while (r := self.requests.get()) is not self._END:
            yield r

    def send(self, request: pb.StepRequest) -> pb.StepResponse:
        self.requests.put(request)
        return next(self.call)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.requests.put(self._END)
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def two(make_server: Callable[..., InProcessServer]) -> Iterator[tuple[KVCoordClient, KVCoordClient]]:
    a, b = make_server(), make_server()
    with KVCoordClient(a.address) as ca, KVCoordClient(b.address) as cb:
        yield ca, cb


def _steps(session_id: str) -> list[pb.StepRequest]:
    """A recorded sequence: two requests registered, one grown, one freed, one more."""
    ops = [
        [allocate("r0", list(range(10)), 10), allocate("r1", list(range(6)), 6)],
        [allocate("r0", None, 3, held=list(range(10)))],
        [pb.Operation(free=pb.FreeOp(request_id="r1")), allocate("r2", list(range(5)), 5)],
        [allocate("r2", None, 4, held=list(range(5))), allocate("r3", list(range(20)), 20)],
    ]
    return [rq.step("p", o, session_id, None) for o in ops]


def _without_fence(r: pb.StepResponse) -> pb.StepResponse:
    r = pb.StepResponse.FromString(r.SerializeToString())
    r.ClearField("fence")  # (each server's own instance id)
    return r


def test_capability_listed(client: KVCoordClient) -> None:
    assert "step_stream" in CAPABILITIES
    assert "step_stream" in client.attach("p", "sha256_cbor", 4, "0").capabilities


def test_stream_answers_as_unary(two: tuple[KVCoordClient, KVCoordClient]) -> None:
    """The same Steps answer the same on a stream as unary (block ids, free blocks,
    usage), and each message counts as one Step in the server's metrics."""
    unary, streamed = two
    s_unary, _ = attach(unary)
    s_stream, _ = attach(streamed)
    expected = [_without_fence(unary.send_step(r)) for r in _steps(s_unary)]
    stream = Stream(streamed.target)
    try:
        got = [_without_fence(stream.send(r)) for r in _steps(s_stream)]
    finally:
        stream.close()
    assert got == expected
    assert (
        streamed.inspect_pool("p", all_requests=True).requests
        == unary.inspect_pool("p", all_requests=True).requests
    )


def test_each_message_counted_as_a_step(make_server: Callable[..., InProcessServer]) -> None:
    server = make_server()
    with KVCoordClient(server.address) as c:
        sid, _ = attach(c)
        stream = Stream(server.address)
        try:
            for r in _steps(sid):
                stream.send(r)
        finally:
            stream.close()
    samples = scrape_metrics(server)
    handled = {
        dict(labels)["grpc_method"]: v
        for (name, labels), v in samples.items()
        if name == "grpc_server_handled_total" and dict(labels).get("grpc_code") == "OK"
    }
    assert handled.get("Step") == 4


def _unary_error(c: KVCoordClient, request: pb.StepRequest) -> tuple[grpc.StatusCode, str, str]:
    try:
        c.stub.Step(request, timeout=ANSWER_WITHIN)
    except grpc.RpcError as exc:
        e = error_from_rpc(exc, "Step")
        return exc.code(), type(e).__name__, getattr(e, "reason", "")
    raise AssertionError("the unary Step was applied")


def _stream_error(stream: Stream, request: pb.StepRequest) -> tuple[grpc.StatusCode, str, str]:
    try:
        stream.send(request)
    except grpc.RpcError as exc:
        e = error_from_rpc(exc, "Step")
        return exc.code(), type(e).__name__, getattr(e, "reason", "")
    raise AssertionError("the streamed Step was applied")


def _bad_steps(session_id: str, fence: pb.Fence, sent: pb.StepRequest) -> dict[str, pb.StepRequest]:
    stale = pb.Fence(instance_id=fence.instance_id, incarnation=fence.incarnation + 1)
    reused = pb.StepRequest.FromString(sent.SerializeToString())  # its key, another body
    reused.ops.append(allocate("x", list(range(4)), 4))
    return {
        "unknown pool": rq.step("nope", [allocate("x", list(range(4)), 4)], session_id, None),
        "stale fence": rq.step("p", [allocate("x", list(range(4)), 4)], session_id, stale),
        "expired session": rq.step("p", [allocate("x", list(range(4)), 4)], "no-such-session", None),
        "key reused": reused,
    }


@pytest.mark.parametrize("kind", ["unknown pool", "stale fence", "expired session", "key reused"])
def test_error_mid_stream_ends_it_with_the_unary_status(
    two: tuple[KVCoordClient, KVCoordClient], kind: str
) -> None:
    """A Step that fails mid-stream ends the stream with the status, error type and
    reason the same Step has as a unary call; nothing sent after it is applied."""
    unary, streamed = two
    s_unary, f_unary = attach(unary)
    s_stream, f_stream = attach(streamed)
    first = _steps(s_unary)[0]
    unary.send_step(first)
    expected = _unary_error(unary, _bad_steps(s_unary, f_unary, first)[kind])
    stream = Stream(streamed.target)
    try:
        first = _steps(s_stream)[0]
        stream.send(first)
        assert _stream_error(stream, _bad_steps(s_stream, f_stream, first)[kind]) == expected
        after = rq.step("p", [allocate("late", list(range(8)), 8)], s_stream, None)
        stream.requests.put(after)  # (the stream has ended: never read)
    finally:
        stream.close()
    assert streamed.get_stats("p").num_free_blocks == unary.get_stats("p").num_free_blocks
    assert "late" not in {t.request_id for t in streamed.inspect_pool("p", all_requests=True).requests}


def test_cancelled_stream_resent_under_its_key_applies_once(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A stream cancelled after its Step was applied but before the answer was read:
    the Step resent under its key, on a new stream and as a unary Step, is answered
    with the first application's blocks and applies nothing again."""
    server = make_server()
    with KVCoordClient(server.address) as c:
        sid, _ = attach(c)
        free_before = c.get_stats("p").num_free_blocks
        request = _steps(sid)[0]
        stream = Stream(server.address)
        stream.requests.put(request)
        for _ in range(1000):  # bounded: until the server applied it
            if c.get_stats("p").num_free_blocks < free_before:
                break
        stream.close()  # the answer was never read
        applied = c.get_stats("p").num_free_blocks
        assert applied < free_before
        again = Stream(server.address)
        try:
            first = again.send(request)
        finally:
            again.close()
        second = c.send_step(request)
        assert first == second
        assert c.get_stats("p").num_free_blocks == applied
        tables = c.inspect_pool("p", all_requests=True).requests
        held = {t.request_id: list(t.groups[0].block_ids) for t in tables}
        assert held["r0"] == list(first.results[0].allocate.new_block_ids[0].block_ids)
        assert sorted(held) == ["r0", "r1"]


def test_stop_ends_an_idle_stream_at_once(make_server: Callable[..., InProcessServer]) -> None:
    """A stream waiting for its next Step is cancelled as the server stops: it never
    holds the stop for its grace period (120 s here; answered within ANSWER_WITHIN)."""
    server = make_server()
    with KVCoordClient(server.address) as c:
        sid, _ = attach(c)
        stream = Stream(server.address)
        try:
            stream.send(_steps(sid)[0])
            running = server.running
            assert running is not None
            stopping = asyncio.run_coroutine_threadsafe(running.stop(120.0), server.loop)
            stopping.result(ANSWER_WITHIN)
            server.running = None
            with pytest.raises(grpc.RpcError) as ended:
                stream.send(_steps(sid)[1])
            assert ended.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        finally:
            stream.close()
