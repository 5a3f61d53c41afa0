"""The client's record of keyed calls given up on (given_up.py), without gRPC: what a
request names, when a record goes, and that a call already built or sent is left as it
is (its body is its idempotency key's: a retry must stay the same)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest
from kvcoord.client import given_up
from kvcoord.client.errors import OutcomeUnknownError, SessionExpiredError, UnavailableError
from kvcoord.v1 import allocator_pb2 as pb

SESSIONS = {"s": "", "t": ""}


@pytest.fixture(autouse=True)
def _sessions() -> Iterator[None]:
    """Session ids of this test alone (the record is the process's)."""
    for name in SESSIONS:
        SESSIONS[name] = uuid.uuid4().hex
    yield


def _sid(name: str = "s") -> str:
    return SESSIONS[name]


def _step(key: str, sequence: int, session: str = "s") -> pb.StepRequest:
    return pb.StepRequest(pool="p", session_id=_sid(session), idempotency_key=key, call_sequence=sequence)


def _give_up(request: pb.StepRequest) -> None:
    given_up.failed("Step", request, OutcomeUnknownError(grpc.StatusCode.UNAVAILABLE, "gone"))


def _named(request: pb.StepRequest) -> list[tuple[str, int]]:
    return [(c.idempotency_key, c.call_sequence) for c in request.abandoned]


def test_a_given_up_call_is_named_by_the_sessions_next_calls_until_one_is_answered() -> None:
    lost = _step("k1", 1)
    _give_up(lost)
    given_up.failed("Step", _step("k0", 0), UnavailableError(grpc.StatusCode.UNAVAILABLE, "known: not sent"))
    assert given_up.given_up(_sid()) == {"k1": 1}
    first, other = _step("k2", 2), _step("x", 1, "t")
    named = given_up.name_on("Step", first)
    assert _named(first) == [("k1", 1)] and named == ["k1"]
    assert given_up.name_on("Step", other) == [] and not other.abandoned  # another session's
    again = given_up.name_on("Step", first)  # a retry of the same request: unchanged
    assert _named(first) == [("k1", 1)] and again == ["k1"]
    given_up.failed("Step", first, OutcomeUnknownError(grpc.StatusCode.UNAVAILABLE, "gone"))
    assert given_up.given_up(_sid()) == {"k1": 1, "k2": 2}
    third = _step("k3", 3)
    given_up.answered("Step", third, given_up.name_on("Step", third))
    assert _named(third) == [("k1", 1), ("k2", 2)]
    assert given_up.given_up(_sid()) == {}


def test_a_call_sent_again_does_not_name_itself_and_its_answer_settles_it() -> None:
    lost = _step("k1", 1)
    _give_up(lost)
    given_up.answered("Step", lost, given_up.name_on("Step", lost))
    assert not lost.abandoned
    assert given_up.given_up(_sid()) == {}


def test_a_sessions_record_goes_with_the_session() -> None:
    _give_up(_step("k1", 1))
    given_up.failed(
        "Heartbeat",
        pb.HeartbeatRequest(session_id=_sid()),
        SessionExpiredError(grpc.StatusCode.NOT_FOUND, "gone"),
    )
    assert given_up.given_up(_sid()) == {}
    _give_up(_step("k1", 1))
    given_up.answered("Heartbeat", pb.HeartbeatRequest(session_id=_sid()), [])  # not a keyed call: kept
    assert given_up.given_up(_sid()) == {"k1": 1}
    given_up.answered("Detach", pb.DetachRequest(session_id=_sid()), [])
    assert given_up.given_up(_sid()) == {}


def test_a_request_names_the_newest_up_to_the_servers_bound() -> None:
    for n in range(1, given_up.MAX_NAMED + 6):
        _give_up(_step(f"k{n}", n))
    request = _step("new", 10_000)
    given_up.name_on("Step", request)
    assert len(request.abandoned) == given_up.MAX_NAMED
    assert (
        request.abandoned[0].call_sequence == 6
        and request.abandoned[-1].call_sequence == given_up.MAX_NAMED + 5
    )
    given_up.answered("Step", request, [c.idempotency_key for c in request.abandoned])
    assert given_up.given_up(_sid()) == {f"k{n}": n for n in range(1, 6)}  # the next call names them


def test_a_call_sent_again_under_its_key_names_what_it_named_first() -> None:
    """Its body is its key's: a request rebuilt with the same key (a Step's pieces sent
    again) names what the first send named, whatever was given up on since."""
    first = _step("k1", 1)
    given_up.name_on("Step", first)
    assert not first.abandoned
    _give_up(_step("k0", 0))
    rebuilt = _step("k1", 1)
    assert given_up.name_on("Step", rebuilt) == [] and not rebuilt.abandoned
    fresh = _step("k2", 2)
    assert given_up.name_on("Step", fresh) == ["k0"]
    again = _step("k2", 2)
    _give_up(_step("k9", 9))
    assert given_up.name_on("Step", again) == ["k0"]
