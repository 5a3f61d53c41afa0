"""A keyed call whose only delivery reaches the server after its client gave up on it
(but within the idempotency window) is never applied.

call_sequence refuses a copy only once the server forgot a key numbered at or above it
(idempotency.py); a call the server never saw has no key to forget. When its client gave
up on it (OutcomeUnknownError: every attempt timed out or was cut off), the waiting-mode
manager treats its requests as lost and frees them in the same session (sender.py:
_failed -> forget -> free_now, FreeOp if_held: applied). Were the call itself to arrive
then (held back on the way: a proxy, a stalled connection) and be applied, an Allocate
would register r1 again, on blocks whose prefix-cache entries another session then hits
though no worker computes that KV, and a Free would free the blocks of r1 admitted again
under its id meanwhile (vLLM reuses ids).

The client now remembers every keyed call it gave up on (client/given_up.py) and names
it in its session's next keyed calls (``abandoned``) until one is answered; the server
keeps a tombstone for each key it does not hold, made inside that call's journal record,
so the late delivery is refused (ABORTED, ANSWER_EVICTED), live, after a restart from
the journal or from a snapshot, and, its window passed, by the session's floor.

Each case goes through the client's own give-up path: :class:`HoldBack` keeps every
attempt of one call from the server (each fails UNAVAILABLE, as a connection cut after
the request left), so the client retries and gives up; the test then delivers the first
attempt's bytes itself, after the client's free. (Before the fix the first three cases
failed: the late Allocate took blocks 15 -> 13 and made r1's prompt a hit of 8 tokens;
the late Free freed the live r1's blocks.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import KVCoordClient, KVCoordError, RemoteKVCacheManager
from kvcoord.client import given_up as given_up_calls
from kvcoord.client.errors import LocalRpcError, OutcomeUnknownError, RequestsLostError
from kvcoord.client.retry import RetryPolicy
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from late_copies import LEASE, PROMPT, SETTINGS, assert_refused, tables
from support import Req, pool_toml

#: two attempts, then OutcomeUnknownError
POLICY = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)


class HoldBack(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """While ``armed``, the first call of ``methods`` and every retry of it (its
    idempotency key) never reach the server: each attempt fails UNAVAILABLE, as if the
    connection broke after the request left. The first attempt's bytes are kept, for
    :meth:`deliver` to bring them to the server later."""

    def __init__(self, methods: set[str]) -> None:
        self.methods = methods
        self.armed = False
        self.held: tuple[str, bytes, str] | None = None  # (method, body, key)
        self.attempts = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        key = getattr(request, "idempotency_key", "")
        if self.armed and method in self.methods and (self.held is None or self.held[2] == key):
            if self.held is None:
                self.held = (method, request.SerializeToString(), key)
            self.attempts += 1
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: the connection broke after sending")
        return continuation(details, request)

    def deliver(self, address: str) -> grpc.RpcError | None:
        """Send the held call now (its only delivery): the server's refusal, or None
        when it was applied."""
        assert self.held is not None
        method, body, _ = self.held
        request = getattr(pb, f"{method}Request").FromString(body)
        with grpc.insecure_channel(address) as channel:
            try:
                getattr(pb_grpc.AllocatorStub(channel), method)(request, timeout=10)
            except grpc.RpcError as err:
                return err
        return None


def _refused_as_given_up(err: grpc.RpcError | None) -> None:
    assert err is not None, "the late delivery of a call its client gave up on was applied"
    assert_refused(err, grpc.StatusCode.ABORTED, "ANSWER_EVICTED")


def _table(client: KVCoordClient, rid: str) -> list[int]:
    return tables(client).get(rid, [])


def _hit(client: KVCoordClient) -> int:
    return client.find_longest_cache_hit("p", hashes(PROMPT), len(PROMPT) + 1).hit.num_tokens


def _if_held_free(rid: str) -> pb.Operation:
    return pb.Operation(free=pb.FreeOp(request_id=rid, if_held=True))


@pytest.mark.parametrize("restart", ["live", "journal", "snapshot"])
def test_an_allocate_delivered_after_its_client_gave_up_is_not_applied(
    make_server: Callable[..., InProcessServer], clock: ManualClock, tmp_path: Path, restart: str
) -> None:
    """The client gives up on an Allocate of r1 and frees r1 (as the managers do: a
    later call of the session, which names the Allocate); the Allocate's only delivery
    comes after that, also after a restart (the tombstone made again from the journal,
    or carried by the snapshot), and again once the window passed (the floor)."""
    data = str(tmp_path / "data")
    wall = lambda: 1.7e9 + clock.now  # noqa: E731
    server = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall, **SETTINGS)
    hold = HoldBack({"Allocate"})
    with KVCoordClient(
        server.address, timeout=10, retry=POLICY, interceptors=[hold], step_stream=False
    ) as client:
        a, a_fence = attach(client)
        attach(client)  # another session of the pool (its lookups would hit r1's blocks)
        hold.armed = True
        with pytest.raises(OutcomeUnknownError):
            client.allocate("p", allocate("r1", PROMPT, 8).allocate, a, a_fence)
        hold.armed = False
        assert hold.attempts == 2
        key = hold.held[2] if hold.held else ""
        assert key in given_up_calls.given_up(a)
        # what the managers do next: free r1 (if held) in the same session
        freed = client.step("p", [_if_held_free("r1")], a, a_fence)
        assert freed.results[0].status_code == 0
        assert given_up_calls.given_up(a) == {}  # named by an answered call: dropped
        free_before = client.get_stats("p").num_free_blocks
    if restart != "live":
        server.stop(snapshot=restart == "snapshot")
        server = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall, **SETTINGS)
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        _refused_as_given_up(hold.deliver(server.address))
        assert client.get_stats("p").num_free_blocks == free_before
        assert _hit(client) == 0
        for _ in range(5):  # the window passes, the session lives: its floor refuses it now
            clock.advance(LEASE / 2)
            client.heartbeat(a, a_fence, pool="p")
        _refused_as_given_up(hold.deliver(server.address))
        assert client.get_stats("p").num_free_blocks == free_before
        assert _hit(client) == 0


def test_a_free_delivered_after_its_client_gave_up_never_frees_the_request_admitted_again(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The Step freeing r1 is given up; the client frees r1 again itself (if_held: applied)
    and admits r1 again under its id (vLLM reuses ids); the given-up Step then arrives."""
    server = make_server(pool_toml("p", 16))
    hold = HoldBack({"Step"})
    with KVCoordClient(
        server.address, timeout=10, retry=POLICY, interceptors=[hold], step_stream=False
    ) as client:
        a, a_fence = attach(client)
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        hold.armed = True
        with pytest.raises(OutcomeUnknownError):
            client.step("p", [pb.Operation(free=pb.FreeOp(request_id="r1"))], a, a_fence)
        hold.armed = False
        again = client.step("p", [_if_held_free("r1")], a, a_fence)
        assert again.results[0].status_code == 0
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        held = _table(client, "r1")
        assert len(held) == 2
        _refused_as_given_up(hold.deliver(server.address))
        assert _table(client, "r1") == held


def test_the_waiting_managers_lost_step_delivered_after_its_free_is_not_applied(
    server: InProcessServer,
) -> None:
    """End to end through RemoteKVCacheManager (waiting mode): the Step admitting "a" is
    given up (RequestsLostError), the sender frees "a" (its free_now names the Step),
    and the Step's only delivery comes after: refused; nothing held, no hit for another
    session."""
    hold = HoldBack({"Step"})
    with KVCoordClient(server.address, timeout=10, retry=POLICY, interceptors=[hold], step_stream=False) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        try:
            req = Req("a", list(PROMPT) + [99])
            hold.armed = True
            with pytest.raises(RequestsLostError) as lost:
                m.allocate_slots(req, len(PROMPT) + 1)
            hold.armed = False
            assert lost.value.request_ids == ["a"]
            assert hold.attempts == 2
            assert c.get_stats("p").num_requests == 0
            free_before = c.get_stats("p").num_free_blocks
            _refused_as_given_up(hold.deliver(server.address))
            assert c.get_stats("p").num_requests == 0
            assert c.get_stats("p").num_free_blocks == free_before
            attach(c)
            assert _hit(c) == 0
        finally:
            m.close()


def test_the_waiting_managers_lost_free_delivered_after_the_request_is_admitted_again_frees_nothing(
    server: InProcessServer,
) -> None:
    """End to end through RemoteKVCacheManager (waiting mode): the Step carrying the free
    of "a" is given up; the sender sends the free again (free_now, if_held: it names the
    Step), vLLM admits "a" again under its id; the Step's only delivery comes after:
    refused; the new "a" keeps its blocks."""
    hold = HoldBack({"Step"})
    with KVCoordClient(server.address, timeout=10, retry=POLICY, interceptors=[hold], step_stream=False) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0")
        try:
            req = Req("a", list(PROMPT) + [99])
            assert m.allocate_slots(req, len(PROMPT) + 1) is not None
            hold.armed = True
            m.free(req)
            with pytest.raises(KVCoordError):
                m.flush()
            hold.armed = False
            assert hold.attempts == 2
            assert c.get_stats("p").num_requests == 0  # freed again by the sender
            again = Req("a", list(PROMPT) + [99])
            assert m.allocate_slots(again, len(PROMPT) + 1) is not None
            held = _table(c, "a")
            assert held
            _refused_as_given_up(hold.deliver(server.address))
            assert _table(c, "a") == held
        finally:
            m.close()
