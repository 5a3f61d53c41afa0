"""A worker whose fence the server refuses FENCE_UNPROVEN attaches again, once told.

A fence's journal position of an earlier server instance beyond what the journal holds,
without the tag the journal issued with it (corrupted on its way; or told by a kvcoord
that did not tag positions, then the volume restored), proves nothing: every call
naming it is refused INVALID_ARGUMENT (FENCE_UNPROVEN) and nothing changes. The session
keeper kept that fence for good: once the session was lost, every Attach sent it again
as ``previous_fence`` and was refused the same way, so the worker could never attach
again (every call of its manager raised FenceUnprovenError, for ever). Now the keeper
forgets the refused position when its Attach is refused (the caller is told, the error
logged), and the next Attach names no previous fence.

Both managers (the waiting one loses its session when its lease lapses, its renewals
refused too; the predicting one at the call after its background Step was refused).
Real server process restarted on its data directory (so the fence's instance is an
earlier one whose last record the journal knows); the position is corrupted where it
happens, in a channel interceptor on one Step answer (unary Steps: step_stream off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import leased_server
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RemoteKVCacheManager
from kvcoord.client.errors import FenceUnprovenError, KVCoordError, RequestsLostError
from kvcoord.v1 import allocator_pb2 as pb
from support import hashed_req

LEASE = 3.0


class _CorruptOneStepFence(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds 2**40 to the fence position of the first Step answer once ``armed`` (its tag
    left as the server gave it: it no longer matches); keeps every AttachRequest sent."""

    def __init__(self) -> None:
        self.armed = False
        self.attaches: list[pb.AttachRequest] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if details.method.endswith("/Attach"):
            self.attaches.append(request)
        outcome = continuation(details, request)
        if details.method.endswith("/Step") and self.armed:
            self.armed = False
            outcome.result().fence.position += 2**40
        return outcome


@contextmanager
def _told_a_corrupted_position(
    tmp_path: Path, kind: str
) -> Iterator[tuple[Any, _CorruptOneStepFence, KVCoordClient]]:
    """A server process; a manager of ``kind`` ("waiting", "predicting") allocates r0,
    then r1, whose Step answer's position is corrupted (the manager adopts it); the
    server is SIGKILLed and restarted on its data directory (the session kept:
    journaled). Yields the manager, the interceptor and an operator's client."""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    corrupt = _CorruptOneStepFence()
    try:
        with KVCoordClient(server.address, timeout=10, interceptors=[corrupt], step_stream=False) as c, \
             KVCoordClient(server.address, timeout=10) as operator:  # fmt: skip
            make = RemoteKVCacheManager if kind == "waiting" else PredictingKVCacheManager
            m = make(c, "p", hash_seed="0", renew=False, lease_seconds=LEASE)
            for rid, first, armed in (("r0", 0, False), ("r1", 100, True)):
                corrupt.armed = armed
                assert m.allocate_slots(hashed_req(rid, list(range(first, first + 16))), 16) is not None
                m.flush()  # (the predicting manager's Step answered: its fence adopted)
            assert not corrupt.armed and m.keeper.fence.position > 2**40  # adopted
            old_session = m.keeper.session_id
            server.restart()
            assert [s.session_id for s in operator.list_sessions("p").sessions] == [old_session]
            yield m, corrupt, operator
            # the Attach that succeeded named no previous fence; the one before named the corrupted one
            assert not corrupt.attaches[-1].HasField("previous_fence")
            assert corrupt.attaches[-2].previous_fence.position > 2**40
            assert [s.session_id for s in operator.list_sessions("p").sessions] == [m.keeper.session_id]
            assert m.keeper.session_id != old_session
            m.close()
    finally:
        server.stop()


def _allocate(m: Any, i: int) -> str:
    """Manager ``m`` allocates request r<i> (16 tokens): "allocated", or the error it
    raised as "Error(cause)"."""
    try:
        allocated = m.allocate_slots(hashed_req(f"r{i}", list(range(200 * i, 200 * i + 16))), 16)
        m.flush()
    except KVCoordError as err:
        cause = err.cause if isinstance(err, RequestsLostError) else err
        return f"{type(err).__name__}({type(cause).__name__})"
    assert allocated is not None
    return "allocated"


def test_a_refused_previous_fence_is_forgotten_and_the_worker_attaches_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The waiting manager's calls are refused FENCE_UNPROVEN until its lease lapses (its
    renewals are refused too), which loses the session; the Attach that follows names
    the corrupted fence and is refused, loudly. The next call attaches without a
    previous fence, the old session is ended by its Detach, and allocation goes on.
    (Before: the Attach was refused at every call, with the same fence, without end.)"""
    with _told_a_corrupted_position(tmp_path, "waiting") as (m, _, _):
        outcomes: list[str] = []
        deadline = time.monotonic() + 6 * LEASE
        for i in range(2, 60):  # bounded: the lease lapses after LEASE s
            outcomes.append(_allocate(m, i))
            if outcomes[-1] == "allocated" or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert outcomes[-1] == "allocated", outcomes
        # the caller was told at every call: its Steps refused, then its requests lost
        unproven = f"{FenceUnprovenError.__name__}({FenceUnprovenError.__name__})"
        assert outcomes[0] == unproven and "RequestsLostError(LeaseExpiredError)" in outcomes, outcomes
        assert set(outcomes[:-1]) <= {unproven, "RequestsLostError(LeaseExpiredError)"}, outcomes
        # the refused Attach (inside the loss) is logged as an error
        assert any(
            r.levelno == logging.ERROR and "refused the fence's journal position" in r.getMessage()
            for r in caplog.records
        ), caplog.text


def test_the_predicting_manager_attaches_again_too(tmp_path: Path) -> None:
    """The same with the predicting manager (its Steps sent from its background thread,
    its session exclusive): its Step refused FENCE_UNPROVEN loses the session at the
    next call, whose Attach is refused for the corrupted fence, loudly; the call after
    attaches without a previous fence and allocation goes on. (Before: every call
    refused, for ever.)"""
    with _told_a_corrupted_position(tmp_path, "predicting") as (m, _, _):
        outcomes: list[str] = []
        for i in range(2, 12):  # bounded
            outcomes.append(_allocate(m, i))
            if outcomes[-2:] == ["allocated", "allocated"]:  # (the first may be predicted before a loss)
                break
        assert outcomes[-2:] == ["allocated", "allocated"], outcomes
        assert any(FenceUnprovenError.__name__ in o for o in outcomes), outcomes
