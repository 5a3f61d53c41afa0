"""A copy of a keyed call delivered after the server forgot its key (the idempotency
window passed): over real gRPC, a raw stub sends the stale copy, byte for byte the call
a session sent a window earlier. It must be refused (ABORTED, ANSWER_EVICTED), never
applied: applied, a Free takes back the blocks of the request that now has that id (a
request preempted and admitted again, as vLLM reuses its ids) and the pool hands them to
another session's request while the first one's worker still writes them; an Allocate
registers a finished request again and caches blocks whose KV nobody writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import allocate, attach, hashes
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from late_copies import LEASE, PROMPT, SETTINGS, WINDOW, assert_refused, send_raw, tables
from support import pool_toml


def _pass_window(clock: ManualClock, client: KVCoordClient, sessions: list[tuple[str, pb.Fence]]) -> None:
    """More than the idempotency window passes; the sessions stay alive (heartbeats)."""
    for _ in range(int(WINDOW / (LEASE / 2)) + 2):
        clock.advance(LEASE / 2)
        for sid, fence in sessions:
            client.heartbeat(sid, fence, pool="p")


def _table(client: KVCoordClient, rid: str) -> list[int]:
    return tables(client).get(rid, [])


def _free_call(rpc: str, sid: str, fence: pb.Fence) -> Any:
    """The call freeing r1 as the client library builds it (key, call_sequence)."""
    if rpc == "Free":
        return KVCoordClient.free.build("p", ["r1"], session_id=sid, fence=fence)
    return KVCoordClient.step.build("p", [pb.Operation(free=pb.FreeOp(request_id="r1"))], sid, fence)


def _admit_call(rpc: str, sid: str, fence: pb.Fence) -> Any:
    """The call admitting r2 as the client library builds it (key, call_sequence)."""
    op = allocate("r2", PROMPT, 8)
    if rpc == "Allocate":
        return KVCoordClient.allocate.build("p", op.allocate, sid, fence)
    return KVCoordClient.step.build("p", [op], sid, fence)


def _applied(answer: Any) -> bool:
    results = getattr(answer, "results", None)
    return results is None or results[0].status_code == 0


def _refused_as_late(address: str, rpc: str, request: Any) -> None:
    """``request`` sent again is ABORTED, ANSWER_EVICTED."""
    with pytest.raises(grpc.RpcError) as refused:
        send_raw(address, rpc, request)
    assert_refused(refused.value, grpc.StatusCode.ABORTED, "ANSWER_EVICTED")
    assert "is not applied now" in str(refused.value.details())


@pytest.mark.parametrize("rpc", ["Step", "Free"])
def test_a_late_free_never_frees_the_request_admitted_again_under_its_id(
    make_server: Callable[..., InProcessServer], clock: ManualClock, rpc: str
) -> None:
    """r1 is allocated, freed (its key K), admitted again under the same id; a window
    later a copy of the freeing call (key K, same bytes) arrives. Old code: the server
    applied it (r1's live blocks freed, the free count up by two) and another session's
    next request was given r1's blocks."""
    server = make_server(pool_toml("p", 16), **SETTINGS)
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        a, a_fence = attach(client)
        b, b_fence = attach(client)
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        freeing = _free_call(rpc, a, a_fence)
        assert freeing.call_sequence and freeing.idempotency_key
        assert _applied(send_raw(server.address, rpc, freeing))
        assert _table(client, "r1") == []
        # r1 admitted again (a preempted request comes back under its id)
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        held = _table(client, "r1")
        assert len(held) == 2
        free_before = client.get_stats("p").num_free_blocks
        _pass_window(clock, client, [(a, a_fence), (b, b_fence)])

        _refused_as_late(server.address, rpc, freeing)  # the stale copy
        assert _table(client, "r1") == held
        # a client that numbers no call is served as before (its new key applied)
        reading = [pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="r1"))]
        unnumbered = pb.StepRequest(
            pool="p", session_id=a, ops=reading, idempotency_key="old-client", fence=a_fence
        )
        assert send_raw(server.address, "Step", unnumbered).results[0].status_code == 0
        assert client.get_stats("p").num_free_blocks == free_before
        # every block another session can get now is one r1 does not hold
        n = free_before * 4
        got = client.step("p", [allocate("b1", list(range(100, 100 + n)), n)], b, b_fence).results[0].allocate
        assert not got.refused
        assert not set(got.new_block_ids[0].block_ids) & set(held)


@pytest.mark.parametrize("rpc", ["Step", "Allocate"])
def test_a_late_allocate_never_registers_a_finished_request_again(
    make_server: Callable[..., InProcessServer], clock: ManualClock, rpc: str
) -> None:
    """r2 is allocated (key K) and finishes (freed); the prefix cache is reset. A window
    later a copy of the allocating Step (key K) arrives. Old code: r2 was registered and
    given blocks again, cached under r2's hashes although no worker writes them: another
    session's lookup of that prompt hit them."""
    server = make_server(pool_toml("p", 16), **SETTINGS)
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        a, a_fence = attach(client)
        b, b_fence = attach(client)
        admitting = _admit_call(rpc, a, a_fence)
        assert _applied(send_raw(server.address, rpc, admitting))
        assert (
            client.step("p", [pb.Operation(free=pb.FreeOp(request_id="r2"))], a, a_fence)
            .results[0]
            .status_code
            == 0
        )
        client.reset_prefix_cache("p")
        free_before = client.get_stats("p").num_free_blocks
        _pass_window(clock, client, [(a, a_fence), (b, b_fence)])

        _refused_as_late(server.address, rpc, admitting)  # the stale copy
        assert _table(client, "r2") == []
        assert client.get_stats("p").num_free_blocks == free_before
        assert client.find_longest_cache_hit("p", hashes(PROMPT), len(PROMPT) + 1).hit.num_tokens == 0


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_restart_does_not_reopen_the_hole(
    make_server: Callable[..., InProcessServer], clock: ManualClock, tmp_path: Path, snapshot: bool
) -> None:
    """The key of r1's free is forgotten, the server restarts (from its journal alone,
    or from a snapshot), and then the late copy arrives: refused as it was before the
    restart, r1's blocks untouched. Old code: applied."""
    data = str(tmp_path / "data")
    wall = lambda: 1.7e9 + clock.now  # noqa: E731  (the journal's record times move with the test clock)
    server = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall, **SETTINGS)
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        a, a_fence = attach(client)
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        freeing = _free_call("Step", a, a_fence)
        assert _applied(send_raw(server.address, "Step", freeing))
        assert client.step("p", [allocate("r1", PROMPT, 8)], a, a_fence).results[0].status_code == 0
        held = _table(client, "r1")
        _pass_window(clock, client, [(a, a_fence)])
        # a call after the window, so that the journal's last record is past it too
        assert client.step("p", [pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="r1"))], a, a_fence)
        _refused_as_late(server.address, "Step", freeing)
    server.stop(snapshot=snapshot)
    again = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall, **SETTINGS)
    with KVCoordClient(again.address, timeout=10, step_stream=False) as client:
        free_before = client.get_stats("p").num_free_blocks
        _refused_as_late(again.address, "Step", freeing)
        assert _table(client, "r1") == held
        assert client.get_stats("p").num_free_blocks == free_before
