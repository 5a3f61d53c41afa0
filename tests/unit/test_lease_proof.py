"""The session keeper's lease proof (SessionKeeper.proven / check_answer), on a manual
clock: an answer later than 0.95 x the lease after its call's send is trusted only when
answered renewals proved the lease without a break from the send to its arrival.
(The same over real gRPC: tests/service/test_late_step_answer_lease.py.)"""

from __future__ import annotations

import pytest
from kvcoord.client import LeaseExpiredError
from kvcoord.client.session import SessionKeeper
from kvcoord.v1 import allocator_pb2 as pb

LEASE = 10.0  # a proof runs 9.5 s from its renewal's send


class _NoClient:
    retry_horizon = 0.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _keeper(clock: _Clock, session: str = "s") -> SessionKeeper:
    attached = pb.AttachResponse(session_id=session, lease_seconds=int(LEASE), idempotency_window_seconds=60)
    return SessionKeeper(_NoClient(), lambda _previous: attached, clock=clock, renew=False)


def test_renewals_sent_before_each_proof_ran_out_prove_a_late_answer() -> None:
    clock = _Clock()
    k = _keeper(clock)  # attached at 100: proven until 109.5
    for sent in (103.0, 109.0, 118.0):  # each before the previous proof ran out
        k.renewed(sent, "s")
    clock.now = 125.0  # a call sent at 104, answered 21 s later (2.1 leases)
    k.check_answer(104.0, "s")
    assert k.proven(100.0, 127.4, "s") and not k.proven(100.0, 127.5, "s")


def test_a_break_in_the_proof_is_not_bridged_by_renewals_answered_after_it() -> None:
    clock = _Clock()
    k = _keeper(clock)  # proven until 109.5
    k.renewed(110.0, "s")  # sent after the proof ran out: a new run [110, 119.5)
    k.renewed(118.0, "s")
    clock.now = 120.0
    assert k.valid_until == 127.5
    with pytest.raises(LeaseExpiredError, match="no unbroken lease proof"):
        k.check_answer(105.0, "s")  # sent in the first run, answered in the second
    k.check_answer(111.0, "s")  # answered within 0.95 x lease of its send: no proof needed
    assert k.proven(110.0, 127.0, "s")  # sent and answered within the second run


def test_a_late_answered_renewal_closes_a_break_whatever_the_order() -> None:
    """Answers come in any order: a renewal sent at 108 (within the first run) but
    answered after one sent at 112 joins both runs into one."""
    clock = _Clock()
    k = _keeper(clock)
    k.renewed(112.0, "s")
    assert not k.proven(101.0, 115.0, "s")
    k.renewed(108.0, "s")
    assert k.proven(101.0, 121.0, "s")
    assert k.proofs == [(100.0, 121.5)]


def test_a_proof_of_another_session_counts_for_nothing() -> None:
    clock = _Clock()
    k = _keeper(clock, "old")
    k.renewed(105.0, "old")
    k.renewed(105.0, "other")  # an answer for a session replaced since: ignored
    assert k.proofs == [(100.0, 114.5)]
    assert not k.proven(101.0, 112.0, "other")
    clock.now = 113.0
    with pytest.raises(LeaseExpiredError):
        k.check_answer(101.0, "other")
    k.check_answer(101.0, "old")
