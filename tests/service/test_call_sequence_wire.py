"""Every client path numbers its keyed calls (call_sequence), as the server receives
them: the blocking client (unary and on the Step stream), the asyncio client, a Step
sent in pieces, the waiting-mode manager's Steps (batch.py), the predicted manager's
Steps (sender.py), and a retry, which keeps its call's number. A call that reached the
server with no number (0) would be applied if a copy of it came late (idempotency.py),
so every keyed Allocate, Free and Step a client library sends must carry one.

The server records each keyed mutation as it arrives (MutationRunner.run, which the
unary calls and every StepStream message go through)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvcoord.client import (
    AsyncKVCoordClient,
    KVCoordClient,
    PredictingKVCacheManager,
    RemoteKVCacheManager,
)
from kvcoord.service.errors import ServiceError, Status
from kvcoord.service.mutations import MutationRunner
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import hashed_req, wire_pool_config

#: (rpc, session, idempotency key, call_sequence) of each keyed call, as it arrived
Arrival = tuple[str, str, str, int]


class _Wire:
    """What the server received; ``fail_first``: the first arrival of these RPCs is
    answered UNAVAILABLE before anything is applied (its client retries it)."""

    def __init__(self) -> None:
        self.arrived: list[Arrival] = []
        self.fail_first: set[str] = set()


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Wire]:
    seen = _Wire()
    run = MutationRunner.run

    async def recorded(self: MutationRunner, m: Any, request: Any, fence: Any) -> bytes:
        if request.idempotency_key:
            seen.arrived.append((m.rpc, request.session_id, request.idempotency_key, request.call_sequence))
        if m.rpc in seen.fail_first:
            seen.fail_first.discard(m.rpc)
            raise ServiceError(Status.UNAVAILABLE, "injected: this attempt was not applied")
        return await run(self, m, request, fence)

    monkeypatch.setattr(MutationRunner, "run", recorded)
    yield seen


def _numbered_in_order(arrived: list[Arrival], pieces: bool = False) -> None:
    """Every call carries a number; a session's calls arrive numbered in increasing order
    (the pieces of one Step share their call's number, with keys of their own)."""
    assert arrived, "no keyed call reached the server"
    assert all(n > 0 for *_, n in arrived), arrived
    by_session: dict[str, list[tuple[str, int]]] = {}
    for _, sid, key, n in arrived:
        by_session.setdefault(sid, []).append((key, n))
    for calls in by_session.values():
        numbers = [n for _, n in calls]
        assert numbers == sorted(numbers), calls
        if not pieces:
            assert len(set(numbers)) == len(calls), calls  # one number per call


def _sync_calls(client: KVCoordClient, pool: str) -> None:
    s = client.attach(pool, "sha256_cbor", 4, "0")
    sid, fence = s.session_id, s.fence
    client.allocate(pool, allocate("a", list(range(9)), 9).allocate, sid, fence)
    client.step(pool, [allocate("b", list(range(20, 29)), 9)], sid, fence)
    client.step(pool, [pb.Operation(free=pb.FreeOp(request_id="b"))], sid, fence)
    client.free(pool, ["a"], session_id=sid, fence=fence)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_blocking_client_numbers_allocate_free_and_step(
    server: InProcessServer, wire: _Wire, stream: bool
) -> None:
    with KVCoordClient(server.address, timeout=10, step_stream=stream) as c:
        c.create_pool("w", wire_pool_config(32))
        _sync_calls(c, "w")
        if stream:
            assert c._carrier.opened >= 1  # (the Steps went on the stream)
    assert [rpc for rpc, *_ in wire.arrived] == ["Allocate", "Step", "Step", "Free"]
    _numbered_in_order(wire.arrived)


def test_the_asyncio_client_numbers_allocate_free_and_step(server: InProcessServer, wire: _Wire) -> None:
    async def main() -> None:
        async with AsyncKVCoordClient(server.address, timeout=10) as c:
            await c.create_pool("w", wire_pool_config(32))
            s = await c.attach("w", "sha256_cbor", 4, "0")
            sid, fence = s.session_id, s.fence
            await c.allocate("w", allocate("a", list(range(9)), 9).allocate, sid, fence)
            await c.step("w", [allocate("b", list(range(20, 29)), 9)], sid, fence)
            await c.free("w", ["a", "b"], session_id=sid, fence=fence)

    asyncio.run(main())
    assert [rpc for rpc, *_ in wire.arrived] == ["Allocate", "Step", "Free"]
    _numbered_in_order(wire.arrived)


def test_the_pieces_of_a_step_carry_its_number(server: InProcessServer, wire: _Wire) -> None:
    with KVCoordClient(server.address, timeout=10, step_stream=False, step_piece_bytes=200) as c:
        c.create_pool("w", wire_pool_config(64))
        s = c.attach("w", "sha256_cbor", 4, "0")
        ops = [allocate(f"r{i}", list(range(100 * i, 100 * i + 9)), 9) for i in range(8)]
        got = c.step("w", ops, s.session_id, s.fence)
        assert [r.status_code for r in got.results] == [0] * 8
    keys = {key for *_, key, _ in wire.arrived}
    numbers = {n for *_, n in wire.arrived}
    assert len(keys) == len(wire.arrived) > 1 and len(numbers) == 1  # pieces: one call
    _numbered_in_order(wire.arrived, pieces=True)


@pytest.mark.parametrize("kind", ["waiting", "predicted"])
def test_the_managers_number_their_steps(client: KVCoordClient, wire: _Wire, kind: str) -> None:
    client.create_pool("m", wire_pool_config(32, events=True))
    if kind == "waiting":
        m: Any = RemoteKVCacheManager(client, "m", hash_seed="0")
    else:
        m = PredictingKVCacheManager(client, "m", hash_seed="0", renew=False)
    try:
        requests = [hashed_req(f"q{i}", list(range(10 * i, 10 * i + 9))) for i in range(3)]
        for r in requests:
            hit, n = m.get_computed_blocks(r)
            assert m.allocate_slots(r, 9 - n, n, hit) is not None
        m.take_events()  # (a predicted manager's Step is sent now)
        for r in requests:
            m.free(r)
        m.take_events()
    finally:
        m.close()
    assert {rpc for rpc, *_ in wire.arrived} <= {"Step", "Free"}
    assert len(wire.arrived) >= 2
    _numbered_in_order(wire.arrived)


def _retried(server: InProcessServer, wire: _Wire, rpc: str, send: Callable[[], None]) -> None:
    wire.fail_first.add(rpc)
    before = len(wire.arrived)
    send()
    assert not wire.fail_first, "the injected failure was never met"
    first, again = wire.arrived[before : before + 2]
    assert first[0] == again[0] == rpc
    assert first == again, "a retry must be the same call: same key, same call_sequence"


@pytest.mark.parametrize("carrier", ["unary", "stream", "asyncio"])
@pytest.mark.parametrize("rpc", ["Step", "Allocate", "Free"])
def test_a_retry_keeps_its_calls_number(server: InProcessServer, wire: _Wire, carrier: str, rpc: str) -> None:
    if carrier == "asyncio":

        async def main() -> None:
            async with AsyncKVCoordClient(server.address, timeout=10) as c:
                await c.create_pool("w", wire_pool_config(32))
                s = await c.attach("w", "sha256_cbor", 4, "0")
                sid, fence = s.session_id, s.fence
                op = allocate("a", list(range(9)), 9)

                async def call() -> None:
                    if rpc == "Step":
                        await c.step("w", [op], sid, fence)
                    elif rpc == "Allocate":
                        await c.allocate("w", op.allocate, sid, fence)
                    else:
                        await c.allocate("w", op.allocate, sid, fence)
                        wire.fail_first.add("Free")
                        await c.free("w", ["a"], session_id=sid, fence=fence)

                wire.fail_first.add(rpc)
                before = len(wire.arrived)
                await call()
                assert not wire.fail_first
                tail = [a for a in wire.arrived[before:] if a[0] == rpc]
                assert len(tail) == 2 and tail[0] == tail[1], tail

        asyncio.run(main())
        _numbered_in_order(wire.arrived, pieces=True)
        return
    with KVCoordClient(server.address, timeout=10, step_stream=carrier == "stream") as c:
        c.create_pool("w", wire_pool_config(32))
        s = c.attach("w", "sha256_cbor", 4, "0")
        sid, fence = s.session_id, s.fence
        op = allocate("a", list(range(9)), 9)
        if rpc == "Step":
            _retried(server, wire, rpc, lambda: c.step("w", [op], sid, fence))
        elif rpc == "Allocate":
            _retried(server, wire, rpc, lambda: c.allocate("w", op.allocate, sid, fence))
        else:
            c.allocate("w", op.allocate, sid, fence)
            _retried(server, wire, rpc, lambda: c.free("w", ["a"], session_id=sid, fence=fence))
    _numbered_in_order(wire.arrived, pieces=True)
