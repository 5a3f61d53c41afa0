"""The asyncio client where it differed from the blocking one, over real gRPC:

- a closed client: a call raises ValueError naming it, as the blocking client's does
  (was: grpc.aio's own UsageError, which no caller of this library expects);
- the server's idempotency window, learned at any Attach: a keyed call is retried no
  longer than half of it (was: the asyncio client kept the default 150 s; the blocking
  one learns it through a manager's session keeper);
- an Attach its caller cancels (``asyncio.wait_for``, a task cancelled) after it
  reached the server: the session it made is ended (was: left live until its lease ran
  out, and an exclusive one answered every other Attach POOL_EXCLUSIVE meanwhile)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcoord.client import AsyncKVCoordClient, KVCoordClient, OutcomeUnknownError
from kvcoord.client.errors import LocalRpcError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import pool_toml

#: the shortest idempotency window the config takes for a lease of 1 s
WINDOW = 2.0
SHORT = {"session_lease_seconds": 1.0, "max_session_lease_seconds": 1.0, "idempotency_window_seconds": WINDOW}
#: a bound on a hang (never reached by the code under test: a call given up on ends in
#: about WINDOW / 2)
HANG = 60.0


def test_a_closed_asyncio_client_raises_value_error_as_the_blocking_one(server: InProcessServer) -> None:
    async def run() -> None:
        c = AsyncKVCoordClient(server.address, timeout=10)
        assert (await c.get_pool("p")).pool.name == "p"
        await c.close()
        with pytest.raises(ValueError, match="GetPool on a closed AsyncKVCoordClient"):
            await c.get_pool("p")
        with pytest.raises(ValueError, match="closed AsyncKVCoordClient"):
            await c.attach("p", "sha256_cbor", 4, "0")

    asyncio.run(run())
    with KVCoordClient(server.address, timeout=10) as blocking:
        pass
    with pytest.raises(ValueError, match="GetPool on a closed KVCoordClient"):
        blocking.get_pool("p")


class LoseAllocatesAio(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Every Allocate's answer is lost: the first reaches the server (applied), every
    retry is cut off before it (UNAVAILABLE)."""

    def __init__(self) -> None:
        self.calls = 0

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not details.method.decode().endswith("/Allocate"):
            return await continuation(details, request)
        self.calls += 1
        if self.calls == 1:
            await (await continuation(details, request))
        raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: the answer was lost")


def test_a_keyed_call_is_retried_within_half_the_window_the_attach_told(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A server keeping answers for WINDOW seconds; the caller's own ``attach`` tells the
    client, which then gives an Allocate whose answers are all lost up after about
    WINDOW / 2 (OutcomeUnknownError), not after the default 90 s."""
    server = make_server(pool_toml("p", 64), **SHORT)
    op = allocate("a", list(range(8)), 8).allocate
    lose = LoseAllocatesAio()

    async def run() -> None:
        async with AsyncKVCoordClient(server.address, timeout=10, interceptors=[lose]) as c:
            s = await c.attach("p", "sha256_cbor", 4, "0")
            assert c.retry_horizon == WINDOW / 2
            with pytest.raises(OutcomeUnknownError):
                await asyncio.wait_for(c.allocate("p", op, s.session_id, s.fence), HANG)

    asyncio.run(run())
    assert lose.calls >= 2  # (retried, then given up on)


class HoldAttach(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The first Attach's answer never comes: with ``applied``, the server made its
    session (the answer is held back until its caller cancels); without, the request
    itself is held back and never sent. Every later call passes."""

    def __init__(self, applied: bool) -> None:
        self.applied = applied
        self.held = asyncio.Event()
        self.first = True

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not details.method.decode().endswith("/Attach") or not self.first:
            return await continuation(details, request)
        self.first = False
        if self.applied:
            await (await continuation(details, request))
        self.held.set()
        await asyncio.sleep(HANG)  # (until cancelled)
        raise AssertionError("the held Attach was never cancelled")


@pytest.mark.parametrize("applied", [True, False])
def test_an_attach_its_caller_cancels_leaves_no_session(server: InProcessServer, applied: bool) -> None:
    """An exclusive Attach cancelled by its caller: whether it reached the server or not,
    once the client is closed the pool has no session of it, and another worker's
    exclusive Attach succeeds (was, applied: PoolBusyError, the session held until its
    lease ran out; the server's clock stands still here, so it never would)."""
    hold = HoldAttach(applied)

    async def run() -> None:
        async with AsyncKVCoordClient(server.address, timeout=10, interceptors=[hold]) as c:
            attach = asyncio.ensure_future(
                c.attach("p", "sha256_cbor", 4, "0", client_name="w", exclusive=True)
            )
            await asyncio.wait_for(hold.held.wait(), HANG)
            attach.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attach

    asyncio.run(run())
    with KVCoordClient(server.address, timeout=10) as other:
        assert list(other.list_sessions("p").sessions) == []
        s = other.attach("p", "sha256_cbor", 4, "0", client_name="other", exclusive=True)
        assert [x.session_id for x in other.list_sessions("p").sessions] == [s.session_id]
        assert isinstance(s, pb.AttachResponse)


def test_an_attach_sent_again_under_a_cancelled_ones_key_gets_a_live_session(server: InProcessServer) -> None:
    """The caller cancels an exclusive Attach (it made a session, its answer held back)
    and sends it again under the same ``attach_key`` at once, as a caller keeping a key
    until an Attach is answered does: the session it is answered with is live and the
    pool's only one (not the cancelled one's, detached under it meanwhile)."""
    hold = HoldAttach(applied=True)

    async def run() -> pb.AttachResponse:
        async with AsyncKVCoordClient(server.address, timeout=10, interceptors=[hold]) as c:
            args = ("p", "sha256_cbor", 4, "0")
            first = asyncio.ensure_future(c.attach(*args, client_name="w", exclusive=True, attach_key="k1"))
            await asyncio.wait_for(hold.held.wait(), HANG)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            again = await c.attach(*args, client_name="w", exclusive=True, attach_key="k1")
            await c.heartbeat(again.session_id, again.fence)
            return again

    again = asyncio.run(run())
    with KVCoordClient(server.address, timeout=10) as other:
        assert [s.session_id for s in other.list_sessions("p").sessions] == [again.session_id]
        other.heartbeat(again.session_id, again.fence)
