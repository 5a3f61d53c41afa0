"""A Free or an Allocate its caller built without an idempotency key, sent through the
blocking client's ``unary``, whose first attempt reaches the server twice (a channel
interceptor sends the same request again: after the first was answered, or both at
once), over real gRPC.

``unary`` keys such a call before its first attempt (``_requests.keyed``), so both
copies carry one key: exactly one is applied, and the answer the caller gets (the
second copy's, or the first's) is the applied one's. Checked against the pool's state
(InspectPool, CheckPool) and a call the interceptor left alone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient
from kvcoord.client.api import Api
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import held_blocks, pool_toml


class Together(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Calls of ``methods`` are sent twice at once (two threads); the caller gets the
    answer of ``answer`` (0: the first copy's, 1: the second's); ``seen`` holds both
    copies' outcomes (a response, or the grpc error)."""

    def __init__(self, methods: tuple[str, ...], answer: int) -> None:
        self.methods, self.answer = methods, answer
        self.seen: list[Any] = []
        self.enabled = True

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not self.enabled or details.method.rsplit("/", 1)[-1] not in self.methods:
            return continuation(details, request)
        outcomes: list[Any] = [None, None]
        start = threading.Barrier(2)

        def send(i: int) -> None:
            start.wait(10)
            outcomes[i] = continuation(details, request)
            try:
                outcomes[i].result()
            except grpc.RpcError:
                pass

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.seen.extend(outcomes)
        return outcomes[self.answer]


def _attached(c: KVCoordClient) -> pb.AttachResponse:
    return c.attach("p", "sha256_cbor", 4, "0", lease_seconds=600)


def _two_requests(c: KVCoordClient, s: pb.AttachResponse) -> None:
    for rid, base in (("a", 0), ("b", 100)):
        got = c.allocate("p", allocate(rid, range(base, base + 16), 16).allocate, s.session_id, s.fence)
        assert not got.result.refused


def _interceptors(kind: str, method: str) -> list[Any]:
    if kind == "after":
        return [FaultInjector(0, duplicate=1.0, methods=(method,))]
    return [Together((method,), answer=0 if kind == "together-first" else 1)]


def _sent_twice(interceptor: Any) -> None:
    """The interceptor did send the call twice (both copies answered, when together)."""
    if isinstance(interceptor, FaultInjector):
        assert interceptor.counts["duplicated"] == 1
        return
    assert len(interceptor.seen) == 2
    for outcome in interceptor.seen:
        outcome.result()  # (raises a copy's refusal)


KINDS = ("after", "together-first", "together-second")


@pytest.mark.parametrize("kind", KINDS)
def test_a_duplicated_unkeyed_free_is_applied_once_and_answered_as_applied(
    make_server: Callable[..., InProcessServer], kind: str
) -> None:
    calm, faulty = make_server(pool_toml("p", 64)), make_server(pool_toml("p", 64))
    answers = []
    faults = _interceptors(kind, "Free")
    for server, interceptors in ((calm, []), (faulty, faults)):
        with KVCoordClient(server.address, timeout=10, interceptors=interceptors) as c:
            s = _attached(c)
            _two_requests(c, s)
            request = pb.FreeRequest(pool="p", session_id=s.session_id, request_ids=["a"], fence=s.fence)
            answer = c.unary(Api.free, request)
            for fault in interceptors:
                fault.enabled = False  # (its first attempt only)
            assert request.idempotency_key and request.call_sequence  # keyed in place
            answers.append(answer.num_free_blocks)
            assert set(held_blocks(c, "p")) == {"b"}
            assert not c.check_pool("p").violations
            assert c.get_stats("p").num_free_blocks == answer.num_free_blocks
            # "b" still held, by this session: a later Free of it is applied (nothing was freed twice)
            after = c.free("p", ["b"], session_id=s.session_id, fence=s.fence)
            assert held_blocks(c, "p") == {}
            answers.append(after.num_free_blocks)
    assert answers[:2] == answers[2:]  # (as the calm server's)
    _sent_twice(faults[0])


@pytest.mark.parametrize("kind", KINDS)
def test_a_duplicated_unkeyed_allocate_is_applied_once_and_answered_as_applied(
    make_server: Callable[..., InProcessServer], kind: str
) -> None:
    calm, faulty = make_server(pool_toml("p", 64)), make_server(pool_toml("p", 64))
    answers = []
    faults = _interceptors(kind, "Allocate")
    for server, interceptors in ((calm, []), (faulty, faults)):
        with KVCoordClient(server.address, timeout=10, interceptors=interceptors) as c:
            s = _attached(c)
            op = allocate("a", range(16), 16).allocate
            request = pb.AllocateRequest(pool="p", session_id=s.session_id, op=op, fence=s.fence)
            answer = c.unary(Api.allocate, request)
            assert request.idempotency_key and request.call_sequence
            assert not answer.result.refused
            ids = list(answer.result.new_block_ids[0].block_ids)
            answers.append((ids, answer.num_free_blocks))
            assert held_blocks(c, "p") == {"a": ids}
            assert c.get_stats("p").num_free_blocks == answer.num_free_blocks
            assert not c.check_pool("p").violations
    assert answers[0] == answers[1]
    _sent_twice(faults[0])
