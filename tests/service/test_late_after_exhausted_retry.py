"""A keyed call whose first attempt's outcome is unknown (held back on the way) and
whose retry is refused RESOURCE_EXHAUSTED because the idempotency budget is full
("nothing was applied: retry later", its key not kept) has not settled that first
attempt: the client must end it in OutcomeUnknownError (and remember it as given up,
given_up.py), never as a typed "nothing applied". Before the fix the client raised
ResourceExhaustedError; the caller rolled r1 back, and the first attempt, delivered once
the budget had room again, registered r1 (its blocks taken, its prompt a hit for another
session on KV nobody wrote)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import KVCoordClient
from kvcoord.client import given_up as given_up_calls
from kvcoord.client.errors import LocalRpcError, OutcomeUnknownError
from kvcoord.client.retry import RetryPolicy
from kvcoord.service.idempotency import entry_bytes
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from support import pool_toml

PROMPT = list(range(1, 9))  # two full blocks of 4 tokens
WINDOW = 20.0
#: two attempts (the second after the first's UNAVAILABLE), then the final error
POLICY = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)


class HoldFirst(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """While ``armed``, the first attempt of the next Allocate never reaches the server
    (UNAVAILABLE, as a connection cut after the request left; its bytes kept for
    :meth:`deliver`); its retries go through."""

    def __init__(self) -> None:
        self.armed = False
        self.held: bytes | None = None

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if self.armed and details.method.endswith("/Allocate") and self.held is None:
            self.held = request.SerializeToString()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: the connection broke after sending")
        return continuation(details, request)

    def deliver(self, address: str) -> grpc.RpcError | None:
        assert self.held is not None
        with grpc.insecure_channel(address) as channel:
            try:
                pb_grpc.AllocatorStub(channel).Allocate(pb.AllocateRequest.FromString(self.held), timeout=10)
            except grpc.RpcError as err:
                return err
        return None


def test_a_retry_refused_for_a_full_idempotency_budget_leaves_the_outcome_unknown(
    make_server: Callable[..., InProcessServer], clock: ManualClock
) -> None:
    probe = "0" * 32  # session ids and keys are 32 hex digits
    budget = 3 * entry_bytes(probe, probe)
    server = make_server(
        pool_toml("p", 16), idempotency_window_seconds=WINDOW, idempotency_max_bytes=budget,
        session_lease_seconds=WINDOW / 2, max_session_lease_seconds=WINDOW / 2,
    )  # fmt: skip
    hold = HoldFirst()
    with KVCoordClient(server.address, timeout=10, retry=POLICY, interceptors=[hold], step_stream=False) as c:
        a, a_fence = attach(c)
        other, _ = attach(c)
        for _ in range(3):  # the budget is full of this half window's keys
            assert c.step("p", [], a, a_fence).results == []
        free_before = c.get_stats("p").num_free_blocks
        hold.armed = True
        with pytest.raises(OutcomeUnknownError):  # (not ResourceExhaustedError: "nothing applied")
            c.allocate("p", allocate("r1", PROMPT, 8).allocate, a, a_fence)
        hold.armed = False
        assert pb.AllocateRequest.FromString(hold.held or b"").idempotency_key in given_up_calls.given_up(a)
        for step in (WINDOW / 4, WINDOW / 4 + 1):  # room again (the keys are past every retry)
            clock.advance(step)
            c.heartbeat(a, a_fence, pool="p")
            c.heartbeat(other, pool="p")
        # what the managers do on an unknown outcome: free r1 (if held), naming the call
        freed = c.step("p", [pb.Operation(free=pb.FreeOp(request_id="r1", if_held=True))], a, a_fence)
        assert freed.results[0].status_code == 0
        err = hold.deliver(server.address)  # the first attempt's only delivery
        assert err is not None and err.code() == grpc.StatusCode.ABORTED, "the held Allocate was applied"
        assert c.get_stats("p").num_free_blocks == free_before
        assert c.find_longest_cache_hit("p", hashes(PROMPT), len(PROMPT) + 1).hit.num_tokens == 0
