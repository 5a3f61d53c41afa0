"""A worker attaching again across a restored volume: the fence of the session it lost
proves the restore (AttachRequest.previous_fence), as any of its other calls would.

A worker whose session was lost starts it again (SessionKeeper.start_again): a Detach of
the old session, then an Attach. When the server is killed and its volume restored
between the two (the Detach answered by the old server, the Attach retried until the
restored one answers), the worker's only call to the restored server was an Attach,
which carried no fence: the restored server, believing the copy, made it a new session
and handed it the blocks a worker of the lost history still held under a running lease
(one chaos run, tests/reliability/test_restarts.py, saw it). Real server process,
``cp -a`` volume copy, SIGKILL; the fault is injected where it happens, in a channel
interceptor right after the Detach's answer arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import (
    DurableServer,
    attach,
    attach_after_grace,
    copy_volume,
    leased_server,
    restore_volume,
    step_allocate,
)
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, FenceUnprovenError, GracePeriodError
from kvcoord.client.session import SessionKeeper
from kvcoord.v1 import allocator_pb2 as pb

LEASE = 4.0


class _AfterDetach(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Runs ``hook`` once, after the first Detach's answer arrived (before its caller sees it)."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self.hook: Callable[[], None] | None = hook

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        if details.method.endswith("/Detach") and self.hook is not None:
            outcome.result()  # answered by the server that ran it
            hook, self.hook = self.hook, None
            hook()
        return outcome


def _keeper(c: KVCoordClient, name: str) -> SessionKeeper:
    """A worker's session of pool ``p`` as the managers keep it (no renewal thread: the
    test calls in order), its Attach sending the lost session's fence through the
    keeper's client (``keeper.client``: the test may swap it)."""
    keeper: SessionKeeper | None = None

    def attach_again(previous: pb.Fence | None) -> pb.AttachResponse:
        through = c if keeper is None else keeper.client
        return through.attach("p", "sha256_cbor", 4, "0", name, lease_seconds=LEASE, previous_fence=previous)

    keeper = SessionKeeper(c, attach_again, renew=False)
    return keeper


def _restore_on_detach(server: DurableServer, copy: Path) -> Callable[[], None]:
    def restore() -> None:
        restore_volume(server, copy)
        server.start()

    return restore


def test_a_worker_attaching_again_across_a_restore_proves_it(tmp_path: Path) -> None:
    """Worker b's session is lost and it starts it again; between its Detach (answered)
    and its Attach the server is SIGKILLed and the volume copied before worker a's last
    allocation is restored. b's Attach names the fence it held (told of records the copy
    lacks): the restore is proven there (FencedError), every session ends, no session
    attaches inside the grace, and worker a's blocks are handed to nobody while its lease
    may still run. (Before: b attached to the copy's pool and was handed a's blocks:
    "blocks [...] handed out twice".)"""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    copy = tmp_path / "snap"
    try:
        hook = _AfterDetach(_restore_on_detach(server, copy))
        with KVCoordClient(server.address) as ca, \
             KVCoordClient(server.address, interceptors=[hook]) as cb, \
             KVCoordClient(server.address, retry=NO_RETRY) as c:  # fmt: skip
            a = attach(ca, "worker-a", LEASE)
            b = _keeper(cb, "worker-b")
            step_allocate(ca, a, "a1", 8)
            copy_volume(server, copy)
            held_by_a = step_allocate(ca, a, "a2", 32)  # records the copy lacks
            told = cb.step("p", [], b.session_id, b.fence)  # b is told a position past the copy
            b.adopt(told.fence)
            assert b.fence.position > 0 and b.fence.position_tag
            # b's session is lost (its client gave up on its lease): it starts it again
            try:
                b.start_again()
            except FencedError:
                pass  # the restore is proven by b's Attach
            else:
                given = step_allocate(cb, b, "b2", 32)
                assert not set(given) & set(held_by_a), (
                    f"blocks {sorted(set(given) & set(held_by_a))} handed out twice"
                )
                raise AssertionError("b attached to the restored copy without proving it")
            assert hook.hook is None  # (the restore happened between b's Detach and its Attach)
            with pytest.raises(FencedError):  # a's session ended with the fencing
                step_allocate(c, a, "a3", 4)
            with pytest.raises(GracePeriodError):
                attach(c, "worker-c", LEASE)
            inspected = c.inspect_pool("p", all_requests=True, include_cached_blocks=True)
            assert not inspected.requests and not inspected.cached_block_ids
            # b's next attempt proves nothing again (its instance settled): it waits out the grace
            b.client = c  # (its Detach and Attach now without retries)
            with pytest.raises(GracePeriodError):
                b.start_again()
        attach_after_grace(server.address, LEASE, "worker-d", 6 * LEASE)
    finally:
        server.stop()


def test_a_made_up_previous_fence_is_refused_and_makes_no_session(tmp_path: Path) -> None:
    """An Attach whose previous_fence names a position past the journal without the tag
    the journal gave it: INVALID_ARGUMENT (FENCE_UNPROVEN), no session made, no grace
    begun (the next Attach is served)."""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    try:
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            a = attach(c, "worker-a", LEASE)
            step_allocate(c, a, "a1", 8)
        server.restart()  # a's instance is now an earlier one the journal holds records of
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            forged = pb.Fence()
            forged.CopyFrom(a.fence)
            forged.position = 10**9
            before = [s.session_id for s in c.list_sessions("p").sessions]
            with pytest.raises(FenceUnprovenError) as refused:
                c.attach("p", "sha256_cbor", 4, "0", "forger", lease_seconds=LEASE, previous_fence=forged)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert [s.session_id for s in c.list_sessions("p").sessions] == before == [a.session_id]
            attach(c, "worker-b", LEASE)  # no grace began
            c.heartbeat(a.session_id, a.fence)  # a's session is untouched
    finally:
        server.stop()
