"""A Free naming more requests than the server's max_ops_per_step goes as several Frees
(step_pieces.free_pieces, keyed KEY/i, answered by the last). Their answers lost, late,
duplicated or delivered again after newer calls (a FaultInjector on the channel, real
server, real gRPC) must free each request exactly once: the pool ends as a fault-free
run leaves it, the caller gets the same free counts and no error, and an old piece
delivered again after its requests' ids were registered anew (vLLM reuses a preempted
request's id) frees none of the new ones (HUNT4 lead 1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from kvcoord.client import (
    InvalidArgumentError,
    KVCoordClient,
    KVCoordError,
    OutcomeUnknownError,
    RequestUnknownError,
)
from kvcoord.client.faults import FaultInjector
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import pool_toml

CAP = 4
N = 10  # requests per round: three Free pieces (4, 4, 2)
ROUNDS = 5
TOML = pool_toml("p", 256)


def _ops(round_: int) -> list[pb.Operation]:
    """Register and allocate r0..r9 (the same ids every round), sharing a prefix with the
    last round's prompts (cache hits), growing a little each round."""
    return [
        allocate(f"r{i}", [*range(16), *range(100 * i, 100 * i + 4 + round_)], 20 + round_) for i in range(N)
    ]


def _state(c: KVCoordClient) -> pb.InspectPoolResponse:
    return c.inspect_pool("p", free_queue_limit=1000, all_requests=True, include_cached_blocks=True)


def _rounds(server: InProcessServer, interceptors: Sequence[Any] = ()) -> tuple[list[int], Any, Any]:
    """ROUNDS rounds of allocating r0..r9 (one Step, never faulted) and freeing them all
    in one ``client.free``; the free counts answered, the pool's state and statistics."""
    with KVCoordClient(server.address, timeout=10, interceptors=list(interceptors), step_stream=False) as c:
        s = c.attach("p", "sha256_cbor", 4, "0")
        counts = []
        for k in range(ROUNDS):
            got = c.step("p", _ops(k), s.session_id, s.fence)
            assert [r.status_code for r in got.results] == [0] * N
            answer = c.free("p", [f"r{i}" for i in range(N)], session_id=s.session_id, fence=s.fence)
            counts.append(answer.num_free_blocks)
        stats = c.get_stats("p")
        return counts, _state(c), (stats.num_free_blocks, stats.num_requests, stats.prefix_cache_stats)


def test_lost_late_and_repeated_answers_of_free_pieces_free_each_request_once(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Per seed, the same rounds on a calm server and on one behind the faults: equal
    free counts, pool state (block tables, free queue, cached blocks) and statistics;
    across the seeds every kind of fault is drawn on Free pieces."""
    drawn = dict.fromkeys(("dropped", "delayed", "duplicated", "reordered"), 0)
    for seed in range(4):
        calm = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
        faulty = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
        want = _rounds(calm)
        assert want[1].requests == [] and want[0][-1] == want[2][0]
        faults = FaultInjector(seed, drop=0.2, delay=0.15, duplicate=0.15, reorder=0.4, methods=("Free",))
        got = _rounds(faulty, [faults])
        assert faults.counts["calls"] >= ROUNDS * 3
        assert got[0] == want[0], f"seed {seed}: the free counts answered differ from a fault-free run"
        assert got[1] == want[1], f"seed {seed}: the pool's state differs from a fault-free run"
        assert got[2] == want[2], f"seed {seed}"
        for k in drawn:
            drawn[k] += faults.counts[k]
        calm.stop()
        faulty.stop()
    assert all(drawn.values()), drawn


def _freeing(make_server: Callable[..., InProcessServer], ids: list[str]) -> tuple[KVCoordError, list[str]]:
    """r0..r5 allocated on a server of max_ops_per_step CAP, then one ``client.free`` of
    ``ids`` (in pieces), which must fail: its error and the requests held after it."""
    server = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
    with KVCoordClient(server.address, timeout=10) as c:
        s = c.attach("p", "sha256_cbor", 4, "0")
        c.step("p", _ops(0)[:6], s.session_id, s.fence)
        with pytest.raises(KVCoordError) as told:
            c.free("p", ids, session_id=s.session_id, fence=s.fence)
        return told.value, sorted(r.request_id for r in c.inspect_pool("p", all_requests=True).requests)


def test_a_later_free_piece_refused_is_told_as_applied_in_part(
    make_server: Callable[..., InProcessServer],
) -> None:
    """One Free checks every id before freeing any: naming an unknown request it frees
    nothing (RequestUnknownError). In pieces, the first ones are freed before a later one
    is refused: the caller is told OutcomeUnknownError ("applied in part", its cause
    the refusal), never a "nothing freed" error while requests were freed (old code:
    RequestUnknownError, r0..r3 freed)."""
    told, held = _freeing(make_server, [*(f"r{i}" for i in range(5)), "nobody"])
    assert isinstance(told, OutcomeUnknownError), repr(told)
    assert isinstance(told.__cause__, RequestUnknownError)
    assert "applied in part" in told.message and "r0" in told.message, told.message
    assert held == ["r4", "r5"]


def test_a_free_naming_a_request_twice_is_refused_before_any_piece(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A request named twice (in different pieces) is refused before anything is sent,
    InvalidArgumentError, as one Free is refused whole (old code: the first piece freed
    r0..r3, the second refused r0 as unknown)."""
    told, held = _freeing(make_server, [*(f"r{i}" for i in range(6)), "r0"])
    assert type(told) is InvalidArgumentError and "twice" in told.message, repr(told)
    assert held == [f"r{i}" for i in range(6)]
