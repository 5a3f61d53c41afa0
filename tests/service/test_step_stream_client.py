"""The blocking client's Step stream (stream_carrier.py) over real gRPC: the answers of
a unary client given the same Steps on another server are the reference, with and
without faults injected on the stream (faults.py)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.client import _requests as rq
from kvcoord.client.errors import FencedError, KVCoordError
from kvcoord.client.faults import FaultInjector
from kvcoord.service import session_calls
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

Make = Callable[..., InProcessServer]


def _ops(n: int, seed: int = 7) -> list[list[pb.Operation]]:
    """``n`` Steps: each registers a request (a prompt of 4-12 tokens, so prefixes hit)
    and frees the one registered three Steps before."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.randint(4, 12)
        ops = [allocate(f"r{i}", list(range(k)), k)]
        if i >= 3:
            ops.append(pb.Operation(free=pb.FreeOp(request_id=f"r{i - 3}")))
        out.append(ops)
    return out


def _run(c: KVCoordClient, steps: list[list[pb.Operation]]) -> tuple[list[pb.StepResponse], Any]:
    """Each Step sent with ``send_step``; the answers (fence cleared) and the pool's
    block tables after them."""
    sid, _ = attach(c)
    answers = []
    for ops in steps:
        r = c.send_step(rq.step("p", ops, sid, None))
        r.ClearField("fence")  # (each server's own instance id)
        answers.append(r)
    return answers, c.inspect_pool("p", all_requests=True, free_queue_limit=1 << 10)


def _reference(make_server: Make, steps: list[list[pb.Operation]]) -> tuple[list[pb.StepResponse], Any]:
    with KVCoordClient(make_server().address, step_stream=False) as c:
        got = _run(c, steps)
        assert c._carrier.opened == 0
        return got


def test_client_streams_steps_as_unary_would(make_server: Make) -> None:
    steps = _ops(12)
    expected = _reference(make_server, steps)
    with KVCoordClient(make_server().address) as c:
        assert _run(c, steps) == expected
        assert c._carrier.opened == 1  # every Step on one stream


def test_server_without_the_capability_gets_unary_steps(make_server: Make, monkeypatch: Any) -> None:
    monkeypatch.setattr(session_calls, "CAPABILITIES", ("decode_op",))  # an older server
    steps = _ops(4)
    expected = _reference(make_server, steps)
    with KVCoordClient(make_server().address) as c:
        assert _run(c, steps) == expected
        assert c._carrier.opened == 0


@pytest.mark.parametrize(
    ("fault", "timeout"),
    [("drop", 10.0), ("delay", 0.3), ("duplicate", 10.0), ("reorder", 10.0)],
)  # (delay: held until the per-Step timeout cancels the stream)
def test_faults_on_the_stream_change_no_answer(make_server: Make, fault: str, timeout: float) -> None:
    """Answers dropped (the stream broken after the server applied the Step), held past
    the per-Step timeout (the stream cancelled), duplicated or old copies delivered
    late: every Step is resent under its key or answered from its kept answer, so the
    answers and the pool match the fault-free unary run block for block."""
    steps = _ops(16)
    expected = _reference(make_server, steps)
    faults = FaultInjector(3, hold_delayed=True, **{fault: 0.3})
    with KVCoordClient(make_server().address, timeout=timeout, interceptors=[faults]) as c:
        got = _run(c, steps)
        opened = c._carrier.opened
    assert got == expected
    injected = {"drop": "dropped", "delay": "delayed", "duplicate": "duplicated", "reorder": "reordered"}[
        fault
    ]
    assert faults.counts[injected] > 0
    if fault in ("drop", "delay"):  # each broke its stream: the Step was resent on a new one
        assert opened == 1 + faults.counts[injected]
    else:
        assert opened == 1


def test_a_step_error_is_the_unary_error_and_the_next_step_goes_on(make_server: Make) -> None:
    """A Step refused on the stream (a stale fence) raises the error the unary Step
    raises; the stream it ended is replaced for the next Step."""
    errors: list[tuple[type[KVCoordError], str]] = []
    for stream in (False, True):
        with KVCoordClient(make_server().address, step_stream=stream) as c:
            sid, fence = attach(c)
            c.send_step(rq.step("p", _ops(1)[0], sid, None))
            stale = pb.Fence(instance_id=fence.instance_id, incarnation=fence.incarnation + 1)
            with pytest.raises(FencedError) as refused:
                c.send_step(rq.step("p", [allocate("x", list(range(4)), 4)], sid, stale))
            errors.append((type(refused.value), refused.value.code.name))
            after = c.send_step(rq.step("p", [allocate("y", list(range(4)), 4)], sid, None))
            assert after.results[0].allocate.new_block_ids
            assert c._carrier.opened == (2 if stream else 0)
    assert errors[0] == errors[1]


def test_partition_fails_like_unary(make_server: Make) -> None:
    """A stream cut before its Step is sent fails as a unary call does (UNAVAILABLE,
    retried until the policy gives up), having applied nothing."""
    from kvcoord.client.retry import RetryPolicy

    server = make_server()
    faults = FaultInjector(0)
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)
    with KVCoordClient(server.address, interceptors=[faults], retry=policy) as c:
        sid, _ = attach(c)
        free = c.get_stats("p").num_free_blocks
        faults.partitioned = True
        with pytest.raises(KVCoordError) as failed:
            c.send_step(rq.step("p", _ops(1)[0], sid, None))
        faults.partitioned = False
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert c.get_stats("p").num_free_blocks == free


class _NotOwner(pb_grpc.AllocatorServicer):
    """A replica that serves Attach for its neighbour (the owner, whose answer lists
    "step_stream") and answers every streamed Step NOT_OWNER naming it."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.channel = grpc.insecure_channel(owner)
        self.refused = 0

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        answer: pb.AttachResponse = pb_grpc.AllocatorStub(self.channel).Attach(request, timeout=10)
        return answer

    def StepStream(self, requests: Iterator[pb.StepRequest], context: grpc.ServicerContext) -> Any:
        for _ in requests:
            self.refused += 1
            context.set_trailing_metadata((("kvcoord-reason", "NOT_OWNER"), ("kvcoord-owner", self.owner)))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"pool p is served by {self.owner}")
        return iter(())


def test_a_streamed_step_follows_not_owner(make_server: Make) -> None:
    """A Step refused NOT_OWNER on a replica's stream is sent to the owner it names
    (NOT_OWNER applied nothing), and answered there as on a single server."""
    steps = _ops(3)
    expected = _reference(make_server, steps)
    owner = make_server()
    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    not_owner = _NotOwner(owner.address)
    pb_grpc.add_AllocatorServicer_to_server(not_owner, fake)
    first = f"127.0.0.1:{fake.add_insecure_port('127.0.0.1:0')}"
    fake.start()
    try:
        with KVCoordClient([first, owner.address]) as c:
            c.routes.redirected("p", first)
            assert _run(c, steps) == expected
            assert not_owner.refused >= 1
            assert c.routes.route("p") == owner.address
    finally:
        fake.stop(None)
        not_owner.channel.close()


def test_the_stream_carries_the_clients_token(make_server: Make) -> None:
    """With auth_tokens, every streamed Step is checked with the client's bearer token
    (the stream's metadata), as a unary Step is."""
    steps = _ops(3)
    expected = _reference(make_server, steps)
    with KVCoordClient(make_server(auth_tokens=("s3cret-token",)).address, token="s3cret-token") as c:
        assert _run(c, steps) == expected
        assert c._carrier.opened == 1
