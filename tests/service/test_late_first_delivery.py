"""OPEN (strict xfail): a numbered keyed call whose only delivery reaches the server
after its client gave up on it, but within the idempotency window, is applied.

call_sequence refuses a copy only once the server forgot a key numbered at or above it
(idempotency.py). A call the server never saw has no key to forget: when its client gave
up on it (OutcomeUnknownError: every attempt timed out or was cut off), the waiting-mode
manager treats its requests as lost and frees them in the same session (sender.py:
_failed -> forget -> free_now, FreeOp if_held: applied). If the call itself then arrives
(held back on the way: a proxy, a stalled connection), it is applied: an Allocate
registers r1 again, on blocks whose prefix-cache entries another session then hits,
though no worker computes that KV; a Free frees the blocks of r1 admitted again under
its id meanwhile (vLLM reuses ids), which the pool then gives to another request.

What would close it (a protocol change, not made here): the client names the keys of
the calls it gave up on in its next call of the session (e.g. StepRequest.abandoned_keys),
and the server keeps each one it does not know as a tombstone under that call's number,
journaled with the call, so the late delivery is refused (ANSWER_EVICTED) and, once the
window passes, the number joins the session's floor."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from support import pool_toml

PROMPT = list(range(1, 9))  # two full blocks of 4 tokens


@pytest.mark.xfail(
    strict=True, reason="open: a call first delivered after its client gave up on it is applied"
)
def test_a_call_delivered_after_its_client_gave_up_is_not_applied(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server(pool_toml("p", 16))
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        a, a_fence = attach(client)
        attach(client)  # another session of the pool
        given_up = KVCoordClient.allocate.build("p", allocate("r1", PROMPT, 8).allocate, a, a_fence)
        # the client gave up on it and freed r1, as the managers do (a later call)
        freed = client.step("p", [pb.Operation(free=pb.FreeOp(request_id="r1", if_held=True))], a, a_fence)
        assert freed.results[0].status_code == 0
        free_before = client.get_stats("p").num_free_blocks
        with grpc.insecure_channel(server.address) as channel:  # its delivery, late
            try:
                pb_grpc.AllocatorStub(channel).Allocate(given_up, timeout=10)
            except grpc.RpcError:
                pass  # refused: what must happen
        assert client.get_stats("p").num_free_blocks == free_before
        assert client.find_longest_cache_hit("p", hashes(PROMPT), len(PROMPT) + 1).hit.num_tokens == 0


def _table(client: KVCoordClient, rid: str) -> list[int]:
    held = {
        r.request_id: list(r.groups[0].block_ids)
        for r in client.inspect_pool("p", all_requests=True).requests
    }
    return held.get(rid, [])


@pytest.mark.xfail(
    strict=True, reason="open: a call first delivered after its client gave up on it is applied"
)
def test_a_free_delivered_after_its_client_gave_up_never_frees_the_request_admitted_again(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The Step freeing r1 is given up; the client frees r1 again itself (if_held: applied)
    and admits r1 again under its id (vLLM reuses ids); the given-up Step then arrives:
    it frees the live r1's blocks."""
    server = make_server(pool_toml("p", 16))
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        a, a_fence = attach(client)
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        given_up = KVCoordClient.step.build("p", [pb.Operation(free=pb.FreeOp(request_id="r1"))], a, a_fence)
        again = client.step("p", [pb.Operation(free=pb.FreeOp(request_id="r1", if_held=True))], a, a_fence)
        assert again.results[0].status_code == 0
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        held = _table(client, "r1")
        assert len(held) == 2
        with grpc.insecure_channel(server.address) as channel:  # its delivery, late
            try:
                pb_grpc.AllocatorStub(channel).Step(given_up, timeout=10)
            except grpc.RpcError:
                pass  # refused: what must happen
        assert _table(client, "r1") == held
