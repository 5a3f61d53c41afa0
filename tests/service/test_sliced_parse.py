"""A large Step's bytes are parsed in slices on the server's event loop (wire_slices.py),
and a long sync's tokens read in slices (long_syncs.py), other tasks running between
them, and what the Step does and answers is as before; bytes that do not parse are
refused as before (a real server over real gRPC)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient
from kvcoord.service import long_syncs, mutating_calls, rpc_guard, wire_slices
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb

POOL = """
[[pools]]
name = "a"
num_blocks = 50000
hash_block_size = 4
[[pools.groups]]
type = "full"
block_size = 4
"""

#: operations of the large Step: about 1 MB on the wire, past PARSE_AT_ONCE_BYTES
N = 12_000


def _ops(n: int = N) -> list[pb.Operation]:
    return [
        pb.Operation(
            allocate=pb.AllocateOp(
                request=pb.RequestSync(request_id=f"r{i}", new_request=True, append_token_ids=[i % 7] * 16),
                num_new_tokens=16,
            )
        )
        for i in range(n)
    ]


@contextlib.contextmanager
def turns_while(server: InProcessServer, flag: list[bool]) -> Iterator[list[int]]:
    """Count the turns a task on the server's loop gets while ``flag[0]`` is true."""
    turns = [0]
    stop = [False]

    async def ticker() -> None:
        for _ in range(10_000_000):  # (bounded; stopped on exit)
            if stop[0]:
                return
            turns[0] += flag[0]
            await asyncio.sleep(0)

    ticking = asyncio.run_coroutine_threadsafe(ticker(), server.loop)
    try:
        yield turns
    finally:
        stop[0] = True
        ticking.result(30)


def test_other_tasks_run_while_a_large_step_is_parsed(
    make_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task on the server's loop counts its turns while the Step's request is being
    parsed (every slice its own turn here): before, gRPC's deserializer parsed it in
    one call and no parse was seen in turns at all."""
    server = make_server(POOL)
    parsing = [False]
    original = wire_slices.parse_in_turns

    async def watched(cls: Any, data: bytes, seconds: float, pause: float) -> Any:
        parsing[0] = True
        try:
            return await original(cls, data, 0.0, 0.0)  # a turn between every two slices
        finally:
            parsing[0] = False

    monkeypatch.setattr(rpc_guard, "parse_in_turns", watched)
    ops = _ops()
    with (
        turns_while(server, parsing) as turns,
        KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c,
    ):
        session = c.attach("a", "", 4, "")
        answer = c.step("a", ops, session.session_id, session.fence)
    assert len(pb.StepRequest(ops=ops).SerializeToString()) > wire_slices.PARSE_AT_ONCE_BYTES
    assert len(answer.results) == N and not any(r.status_code or r.allocate.refused for r in answer.results)
    # at least one turn between two slices of PARSE_SLICE_BYTES
    assert turns[0] >= len(pb.StepRequest(ops=ops).SerializeToString()) // wire_slices.PARSE_SLICE_BYTES - 1


def test_a_step_parsed_in_slices_answers_as_one_parsed_at_once(
    make_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same large Step, parsed in slices and parsed at once (the threshold raised):
    the same answer (the fence aside) and the same retry answer."""
    got = []
    for at_once in (wire_slices.PARSE_AT_ONCE_BYTES, 1 << 40):
        monkeypatch.setattr(wire_slices, "PARSE_AT_ONCE_BYTES", at_once)
        server = make_server(POOL)
        with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
            session = c.attach("a", "", 4, "")
            request = pb.StepRequest(
                pool="a", session_id=session.session_id, fence=session.fence, ops=_ops(), idempotency_key="k1"
            )
            first = c.send_step(request)
            again = c.send_step(request)  # a retry: the kept answer
            assert again == first
            first.ClearField("fence")
            got.append((first.SerializeToString(), c.get_stats("a").num_free_blocks))
    assert got[0] == got[1]


def test_a_large_step_that_does_not_parse_is_refused_as_invalid(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server(POOL)
    data = pb.StepRequest(pool="a", ops=_ops()).SerializeToString()
    assert len(data) > wire_slices.PARSE_AT_ONCE_BYTES
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/kvcoord.v1.Allocator/Step")
        for bad in (data[:-3], data + b"\xff"):
            with pytest.raises(grpc.RpcError) as err:
                call(bad, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid kvcoord.v1.StepRequest" in str(err.value.details())


@pytest.mark.parametrize("rpc", ["Step", "Allocate"])
def test_other_tasks_run_while_a_long_sync_is_read(
    make_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch, rpc: str
) -> None:
    """One AllocateOp of 262,144 tokens (a Step's, an Allocate's): a task on the server's loop gets turns while
    its tokens are read (long_syncs.py), which was one call before."""
    server = make_server(POOL)
    server.running.servicer.mutations.slice_seconds = 0.0  # type: ignore[union-attr]  # a turn per slice
    reading = [False]
    original = long_syncs.allocate_in_slices

    def watched(a: Any, groups: int) -> Any:
        reading[0] = True
        try:
            return (yield from original(a, groups))
        finally:
            reading[0] = False

    monkeypatch.setattr(mutating_calls, "allocate_in_slices", watched)
    n = 262_144
    sync = pb.RequestSync(request_id="long", new_request=True, append_token_ids=[k % 97 for k in range(n)])
    a = pb.AllocateOp(request=sync, num_new_tokens=n // 8)
    with (
        turns_while(server, reading) as turns,
        KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c,
    ):
        session = c.attach("a", "", 4, "")
        if rpc == "Step":
            (result,) = c.step("a", [pb.Operation(allocate=a)], session.session_id, session.fence).results
            assert not result.status_code
            answer = result.allocate
        else:
            answer = c.allocate("a", a, session.session_id, session.fence).result
    assert len(answer.new_block_ids[0].block_ids) == n // 32
    assert turns[0] >= n // long_syncs.TOKENS_SLICE - 1
