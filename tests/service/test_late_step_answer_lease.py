"""A Step answered later than 0.95 x the session lease after it was sent, over real gRPC
(an in-process server on its real clock, a channel interceptor holding the Step's
answer back as a stalled journal write does), with RemoteKVCacheManager's background
renewals going on meanwhile.

- Every renewal answered on time (no break in the client's lease proof from the Step's
  send to its answer's arrival): the answer is trusted, nothing is lost, and the block
  ids are the server's. (Before, every request of the session was reported lost:
  "the answer came after the session's lease could have ended".)
- The renewals' answers lost for longer than the lease while the Step waits, renewals
  answered again before its answer arrives: the proof had a break, so the answer is
  not trusted: RequestsLostError names every request of the session (never a guess).

The restarted-replica bound (a Step answered by a new process after a gap longer than
the lease, renewals failing meanwhile) is tests/reliability/test_rolling_restart.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, LeaseExpiredError, RemoteKVCacheManager, RequestsLostError
from kvcoord.client.errors import LocalRpcError
from kvcoord.service.testing import InProcessServer
from support import Req, held_blocks, pool_toml

LEASE = 2.0
#: how far past send + 0.95 x lease a held Step answer is delivered
PAST = 0.6


class _Answers:
    """What the interceptor does: holds the answer of the Step it is armed for until
    its time has come, and loses the answers of renewals sent while ``lose_renewals``."""

    def __init__(self) -> None:
        self.armed = False
        #: called (on the Step's thread) with the Step's start; returns once it may be answered
        self.hold: Callable[[float], None] = lambda start: None
        self.lose_renewals = False
        self.renewals_lost = 0
        #: monotonic times renewals were answered (and delivered to the caller)
        self.renewals_answered: list[float] = []
        self.held = 0
        self._lock = threading.Lock()

    def step_answered(self, start: float) -> None:
        with self._lock:
            armed, self.armed = self.armed, False
        if armed:
            self.held += 1
            self.hold(start)

    def renewal(self, continuation: Any, details: Any, request: Any) -> Any:
        lose = self.lose_renewals
        answer = continuation(details, request)
        if lose:
            try:
                answer.result()  # the server received and renewed it: only the answer is lost
            except grpc.RpcError:
                pass
            self.renewals_lost += 1
            # (as an answer after the call's deadline: a renewal is not retried then)
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "injected: renewal answered too late")
        answer.result()
        self.renewals_answered.append(time.monotonic())
        return answer


class _Stream:
    """A StepStream call whose answers pass through :meth:`_Answers.step_answered`."""

    def __init__(self, call: Any, answers: _Answers) -> None:
        self.call = call
        self.answers = answers

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        start = time.monotonic()
        answer = next(self.call)
        self.answers.step_answered(start)
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.call, name)


class _Interceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, answers: _Answers) -> None:
        self.answers = answers

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        if method == "Heartbeat":
            return self.answers.renewal(continuation, details, request)
        start = time.monotonic()
        answer = continuation(details, request)
        if method == "Step":
            answer.result()
            self.answers.step_answered(start)
        return answer

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        call = continuation(details, requests)
        return _Stream(call, self.answers) if details.method.endswith("/StepStream") else call


@pytest.fixture
def worker(request: pytest.FixtureRequest) -> Iterator[tuple[RemoteKVCacheManager, _Answers]]:
    """A manager (lease 2 s, renewed in the background) on a real-clock server, its
    Steps on a stream or unary (the fixture's param)."""
    server = InProcessServer(pool_toml("p", 64)).start()
    answers = _Answers()
    try:
        with KVCoordClient(
            server.address, timeout=30, interceptors=[_Interceptor(answers)], step_stream=request.param
        ) as c:
            m = RemoteKVCacheManager(c, "p", hash_seed="0", lease_seconds=LEASE)
            try:
                assert m.keeper.lease == LEASE
                yield m, answers
            finally:
                m.close()
    finally:
        server.stop()


def _place(m: RemoteKVCacheManager, r: Req) -> list[int]:
    assert m.allocate_slots(r, len(r.all_token_ids)) is not None
    return list(m.get_block_ids(r.request_id)[0])


def _answered_after(answers: _Answers, since: float) -> int:
    return sum(1 for t in answers.renewals_answered if t > since)


@pytest.mark.parametrize("worker", [True, False], ids=["stream", "unary"], indirect=True)
def test_a_late_step_answer_is_kept_while_renewals_proved_the_lease_throughout(worker: Any) -> None:
    """The Step's answer is held past send + 0.95 x lease (+0.6 s) and until at least
    three renewals sent after the Step were answered: the lease was proven without a
    break, so the manager keeps its requests and the block ids match the server's."""
    m, answers = worker
    session = m.session_id
    a = _place(m, Req("a", list(range(100, 117))))
    m.flush()

    def hold(start: float) -> None:
        due = start + LEASE * 0.95 + PAST
        for _ in range(400):  # bounded: 20 s
            if time.monotonic() >= due and _answered_after(answers, start) >= 3:
                return
            time.sleep(0.05)
        raise AssertionError("the renewals were not answered while the Step waited")

    answers.hold = hold
    answers.armed = True
    b = _place(m, Req("b", list(range(200, 209))))
    m.flush()
    assert answers.held == 1
    assert m.lost_requests == 0 and m.session_id == session
    assert held_blocks(m.client, "p") == {"a": a, "b": b}


@pytest.mark.parametrize("worker", [True, False], ids=["stream", "unary"], indirect=True)
def test_a_late_step_answer_after_a_break_in_the_lease_proof_loses_the_requests_loudly(worker: Any) -> None:
    """The renewals' answers are lost from the Step's send until past send + 0.95 x
    lease (the server renewed the session, but the client cannot know it: its proof
    ran out), then renewals are answered again before the Step's answer arrives. A
    renewal answered after the Step is not enough: the break makes the answer
    untrusted, every request of the session is reported lost and a new session is
    attached."""
    m, answers = worker
    session = m.session_id
    _place(m, Req("a", list(range(100, 117))))
    m.flush()

    def hold(start: float) -> None:
        answers.lose_renewals = True
        for _ in range(400):  # bounded: 20 s
            if time.monotonic() >= start + LEASE * 0.95 + PAST and answers.renewals_lost >= 2:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("no renewal was attempted while the Step waited")
        answers.lose_renewals = False
        healed = time.monotonic()
        for _ in range(400):
            if _answered_after(answers, healed) >= 2:
                return
            time.sleep(0.05)
        raise AssertionError("the renewals were not answered again")

    answers.hold = hold
    answers.armed = True
    lost: RequestsLostError | None = None
    try:
        _place(m, Req("b", list(range(200, 209))))
    except RequestsLostError as err:
        lost = err
    assert answers.held == 1
    assert lost is not None and {"a", "b"} <= set(lost.request_ids), lost
    assert isinstance(lost.cause, LeaseExpiredError), lost.cause
    assert m.session_id != session
    c = _place(m, Req("c", list(range(300, 312))))
    m.flush()
    assert held_blocks(m.client, "p") == {"c": c}
