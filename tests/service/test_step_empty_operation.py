"""A Step carrying an Operation with no op set (a client built it wrong, or a newer
client sent an op this server does not know: protobuf drops unknown oneof members),
sent on a raw stub over real gRPC: the whole Step is refused INVALID_ARGUMENT naming
the cause, before anything is applied. The operations before the empty one change
nothing, the refusal is not kept under the Step's key (the same bytes again are
refused again, never answered as applied), and the session and its pool go on
serving (the pool's hold is given back, on the sliced path too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.client import _requests as rq
from kvcoord.client.errors import InvalidArgumentError, error_from_rpc
from kvcoord.service.mutations import SLICE_OPS, Mutation, MutationRunner
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from support import pool_toml

#: a deadline for calls that answer at once on a sound server
ANSWER_WITHIN = 10.0

#: one full-attention group of 4-token blocks, prefix caching and KV events on
POOL = pool_toml("p", 1024)


def _pool_state(c: KVCoordClient) -> tuple[int, list[tuple[str, list[int]]], int]:
    stats = c.get_stats("p")
    held = [
        (t.request_id, [b for g in t.groups for b in g.block_ids])
        for t in c.inspect_pool("p", all_requests=True).requests
    ]
    return stats.num_free_blocks, sorted(held), stats.num_requests


def _refused(stub: pb_grpc.AllocatorStub, request: pb.StepRequest) -> tuple[grpc.StatusCode, str, type]:
    try:
        stub.Step(request, timeout=ANSWER_WITHIN)
    except grpc.RpcError as exc:
        return exc.code(), str(exc.details()), type(error_from_rpc(exc, "Step"))
    raise AssertionError("a Step with an operation that has no op set was answered as applied")


@pytest.mark.parametrize(
    "ops_before, sliced",
    [(0, False), (3, False), (SLICE_OPS * 4, True)],
    ids=["alone", "after-three-allocations", "sliced-after-many"],
)
def test_step_with_an_empty_operation_is_refused_and_changes_nothing(
    make_server: Callable[..., InProcessServer],
    monkeypatch: pytest.MonkeyPatch,
    ops_before: int,
    sliced: bool,
) -> None:
    server = make_server(POOL)
    went_sliced: list[str] = []
    if sliced:  # every Step goes on in a task of its own that holds the pool (mutations.py)
        server.running.servicer.mutations.slice_seconds = 0.0  # type: ignore[union-attr]
        original = MutationRunner._sliced

        def counted(self: MutationRunner, m: Mutation[Any], *args: Any) -> Any:
            went_sliced.append(m.rpc)
            return original(self, m, *args)

        monkeypatch.setattr(MutationRunner, "_sliced", counted)
    with (
        KVCoordClient(server.address, timeout=ANSWER_WITHIN) as c,
        grpc.insecure_channel(server.address) as ch,
    ):
        stub = pb_grpc.AllocatorStub(ch)
        session, fence = attach(c)
        c.send_step(rq.step("p", [allocate("held", list(range(500, 512)), 12)], session, fence))
        before = _pool_state(c)
        went_sliced.clear()
        ops = [allocate(f"r{i}", list(range(i, i + 8)), 8) for i in range(ops_before)]
        request = rq.step("p", [*ops, pb.Operation()], session, fence)
        assert request.ops[-1].WhichOneof("op") is None
        code, details, error = _refused(stub, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "operation has no op set" in details
        assert issubclass(error, InvalidArgumentError)
        assert _pool_state(c) == before
        assert went_sliced == (["Step"] if sliced else [])  # the path this case is about ran
        # the same bytes again (a retry under the same key): refused again, not a kept answer
        assert _refused(stub, request)[:2] == (code, details)
        assert _pool_state(c) == before
        # the session and the pool serve on (the pool's hold was given back)
        answer = c.send_step(
            rq.step("p", [*ops, allocate("after", list(range(1000, 1008)), 8)], session, fence)
        )
        assert len(answer.results) == ops_before + 1
        assert not any(r.status_code or r.allocate.refused for r in answer.results)
        assert _pool_state(c)[0] == before[0] - 2 * (ops_before + 1)


def test_stream_step_with_an_empty_operation_ends_the_stream_invalid(
    make_server: Callable[..., InProcessServer],
) -> None:
    """On a StepStream: the stream ends with the same INVALID_ARGUMENT; nothing applied."""
    server = make_server(POOL)
    with (
        KVCoordClient(server.address, timeout=ANSWER_WITHIN) as c,
        grpc.insecure_channel(server.address) as ch,
    ):
        session, fence = attach(c)
        before = _pool_state(c)
        request = rq.step("p", [allocate("r0", list(range(8)), 8), pb.Operation()], session, fence)
        call = pb_grpc.AllocatorStub(ch).StepStream(iter([request]), timeout=ANSWER_WITHIN)
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "operation has no op set" in str(err.value.details())
        assert _pool_state(c) == before
