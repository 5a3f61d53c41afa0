"""A Step its client gave up on, first delivered after the client freed its request, is
never applied: the same case as test_late_first_delivery.py on every carrier of Steps
(a unary call, the StepStream, the asyncio client).

Here the server itself holds the call back: every attempt of the first Step admitting r1
reaches MutationRunner.run and is answered UNAVAILABLE before anything is looked at or
applied (as a connection that broke), so the client retries it and gives up
(OutcomeUnknownError); its bytes are kept and delivered by the test after the client's
free of r1 (if_held, in the same session, as the managers do)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import AsyncKVCoordClient, KVCoordClient
from kvcoord.client.errors import OutcomeUnknownError
from kvcoord.client.retry import RetryPolicy
from kvcoord.service.errors import ServiceError, Status
from kvcoord.service.mutations import MutationRunner
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from support import pool_toml

PROMPT = list(range(1, 9))
POLICY = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)


class _Held:
    def __init__(self) -> None:
        self.armed = False
        self.key = ""
        self.body = b""
        self.attempts = 0


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Held]:
    h = _Held()
    run = MutationRunner.run

    async def holding(self: MutationRunner, m: Any, request: Any, fence: Any) -> bytes:
        if h.armed and m.rpc == "Step" and h.key in ("", request.idempotency_key):
            if not h.key:
                h.key, h.body = request.idempotency_key, request.SerializeToString()
            h.attempts += 1
            raise ServiceError(Status.UNAVAILABLE, "injected: held back on the way")
        return await run(self, m, request, fence)

    monkeypatch.setattr(MutationRunner, "run", holding)
    yield h


def _admit() -> list[pb.Operation]:
    return [allocate("r1", PROMPT, 8)]


def _free() -> list[pb.Operation]:
    return [pb.Operation(free=pb.FreeOp(request_id="r1", if_held=True))]


async def _give_up_and_free_async(address: str, h: _Held) -> None:
    async with AsyncKVCoordClient(address, timeout=10, retry=POLICY) as c:
        s = await c.attach("p", "sha256_cbor", 4, "0")
        h.armed = True
        with pytest.raises(OutcomeUnknownError):
            await c.step("p", _admit(), s.session_id, s.fence)
        h.armed = False
        assert (await c.step("p", _free(), s.session_id, s.fence)).results[0].status_code == 0


@pytest.mark.parametrize("carrier", ["unary", "stream", "asyncio"])
def test_a_given_up_step_delivered_after_the_free_is_not_applied(
    make_server: Any, held: _Held, carrier: str
) -> None:
    server: InProcessServer = make_server(pool_toml("p", 16))
    if carrier == "asyncio":
        asyncio.run(_give_up_and_free_async(server.address, held))
    else:
        with KVCoordClient(server.address, timeout=10, retry=POLICY, step_stream=carrier == "stream") as c:
            a, a_fence = attach(c)
            held.armed = True
            with pytest.raises(OutcomeUnknownError):
                c.step("p", _admit(), a, a_fence)
            held.armed = False
            assert c.step("p", _free(), a, a_fence).results[0].status_code == 0
    assert held.attempts == 2
    with KVCoordClient(server.address, timeout=10, step_stream=False) as c:
        attach(c)  # another session: would hit r1's blocks
        free_before = c.get_stats("p").num_free_blocks
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.AllocatorStub(channel).Step(pb.StepRequest.FromString(held.body), timeout=10)
        err = refused.value
        assert err.code() == grpc.StatusCode.ABORTED, f"{err.code()} {err.details()}"
        assert ("kvcoord-reason", "ANSWER_EVICTED") in (err.trailing_metadata() or ())
        assert c.get_stats("p").num_free_blocks == free_before
        assert c.find_longest_cache_hit("p", hashes(PROMPT), len(PROMPT) + 1).hit.num_tokens == 0
