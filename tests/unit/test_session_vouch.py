"""SessionKeeper.vouch on a manual clock, every branch: a session ended raises its own
error at once (no renewal tried); a lease still running says nothing; a lease run out
is renewed once, synchronously, and then says nothing, raises the error that ended the
session, or LeaseExpiredError when the renewal was not answered. Each counts the clock's
reads and the renewals sent, so that a rewrite of vouch keeps its order of checks."""

from __future__ import annotations

import grpc
import pytest
from kvcoord.client import LeaseExpiredError, SessionExpiredError, UnavailableError
from kvcoord.client.session import SessionKeeper
from kvcoord.v1 import allocator_pb2 as pb

LEASE = 10.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class _Client:
    """Answers each heartbeat with ``answer`` (an error is raised)."""

    retry_horizon = 0.0

    def __init__(self) -> None:
        self.answer: object = pb.HeartbeatResponse()
        self.heartbeats = 0

    def heartbeat(self, session_id: str, fence: pb.Fence) -> object:
        self.heartbeats += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _keeper() -> tuple[SessionKeeper, _Clock, _Client]:
    clock, client = _Clock(), _Client()
    attached = pb.AttachResponse(session_id="s", lease_seconds=int(LEASE), idempotency_window_seconds=60)
    keeper = SessionKeeper(client, lambda _previous: attached, clock=clock, renew=False)
    clock.reads = 0
    return keeper, clock, client


def test_a_lease_still_running_is_vouched_for_with_one_clock_read() -> None:
    keeper, clock, client = _keeper()
    clock.now += 1.0
    keeper.vouch()
    assert (clock.reads, client.heartbeats) == (1, 0)


def test_a_session_ended_raises_its_own_error_without_renewing() -> None:
    keeper, clock, client = _keeper()
    ended = SessionExpiredError(grpc.StatusCode.NOT_FOUND, "session gone")
    keeper.lost = ended
    clock.now += 3 * LEASE
    with pytest.raises(SessionExpiredError) as caught:
        keeper.vouch()
    assert caught.value is ended
    assert (clock.reads, client.heartbeats) == (0, 0)


def test_a_lease_run_out_is_renewed_once_and_then_vouched_for() -> None:
    keeper, clock, client = _keeper()
    clock.now += LEASE
    keeper.vouch()
    # the check, the renewal's send, the check after it
    assert (clock.reads, client.heartbeats) == (3, 1)


def test_a_lease_run_out_whose_renewal_finds_the_session_gone_raises_that() -> None:
    keeper, clock, client = _keeper()
    client.answer = SessionExpiredError(grpc.StatusCode.NOT_FOUND, "session gone")
    clock.now += LEASE
    with pytest.raises(SessionExpiredError) as caught:
        keeper.vouch()
    assert caught.value is client.answer
    assert (clock.reads, client.heartbeats) == (2, 1)  # not read again after the loss


def test_a_lease_run_out_whose_renewal_is_not_answered_raises_lease_expired() -> None:
    keeper, clock, client = _keeper()
    client.answer = UnavailableError(grpc.StatusCode.UNAVAILABLE, "down")
    clock.now += LEASE
    with pytest.raises(LeaseExpiredError, match="no lease renewal acknowledged"):
        keeper.vouch()
    assert keeper.lost is None
    assert (clock.reads, client.heartbeats) == (3, 1)
