"""vLLM 0.16.0's schedulers on a shared pool in the waiting mode (KVCOORD_EXCLUSIVE=0,
KVCOORD_PREDICT=0), under the KV-content oracle: every call is cut off for twice the
session lease, so the client gives up on its lease (the server, whose clock stands
still, still holds the session and its requests). The manager reports every request
lost and ends the session before making a new one (``SessionKeeper.start_again``); the
first Detach that gets through is applied and its answer lost. The client cannot tell
that from a Detach that never arrived: it waits, and the next call sends the Detach
again, is told the session is unknown (ended by the first), attaches, and the
scheduler recomputes the lost requests under their ids. Every request completes with
vLLM's own tokens, every scheduled request reads its own KV, and the pool ends sound
with no session and no request left (tests/service/test_lost_detach_answer.py is the
same at the manager's level)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import kv_cache_config, make_scheduler
from kv_oracle import KVOracle
from kvcoord.client import KVCoordClient
from kvcoord.client import vllm as kvcoord_vllm
from kvcoord.client.errors import LocalRpcError
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer, ManualClock
from test_lost_answers import BLOCKS, _config, _run, _want

LEASE = 1.0
POOL = "lost-detach"


class CutThenLoseDetach(FaultInjector):
    """While ``partitioned``, every call is cut off (FaultInjector's partition); the
    first ``drop_detaches`` Detaches after it reach the server and lose their answers."""

    def __init__(self) -> None:
        super().__init__(0, methods=())
        self.drop_detaches = 0
        #: every Detach that reached the server: (session id, what the caller was told)
        self.detaches: list[tuple[str, str]] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if self.partitioned or not details.method.endswith("/Detach"):
            return super().intercept_unary_unary(continuation, details, request)
        answer = continuation(details, request)
        try:
            answer.result()
        except grpc.RpcError as err:
            self.detaches.append((request.session_id, err.code().name))
            return answer
        if self.drop_detaches:
            self.drop_detaches -= 1
            self.detaches.append((request.session_id, "applied, its answer lost"))
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: the Detach's answer was lost")
        self.detaches.append((request.session_id, "OK"))
        return answer


@pytest.fixture
def still_server() -> Iterator[InProcessServer]:
    """A server whose session clock stands still (no lease runs out there)."""
    srv = InProcessServer(
        clock=ManualClock(), session_lease_seconds=LEASE, max_session_lease_seconds=LEASE
    ).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_lost_detach_answer_after_a_lease_given_up_costs_only_recomputation(
    kind: str, model_dir: Path, still_server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    want = _want(model_dir, kind, "full")
    faults = CutThenLoseDetach()
    healed = threading.Event()

    def faulty_client(target: str, **kw: Any) -> KVCoordClient:
        return KVCoordClient(target, interceptors=[faults], **kw)

    def heal() -> None:
        faults.partitioned = False
        healed.set()

    timer = threading.Timer(2 * LEASE, heal)

    def on_step(step: int) -> None:
        if step == 30:
            faults.drop_detaches = 1
            faults.partitioned = True
            timer.start()

    monkeypatch.setattr(kvcoord_vllm, "KVCoordClient", faulty_client)
    monkeypatch.setenv("KVCOORD_TARGET", still_server.address)
    monkeypatch.setenv("KVCOORD_POOL", POOL)
    monkeypatch.setenv("KVCOORD_PREDICT", "0")
    monkeypatch.setenv("KVCOORD_EXCLUSIVE", "0")
    monkeypatch.setenv("KVCOORD_MAX_OUTAGE", "60")
    cls = KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler
    s = make_scheduler(cls, _config(model_dir, kind), kv_cache_config("full", BLOCKS))
    oracle = KVOracle(s)
    manager = s.kv_cache_manager.remote
    first = manager.session_id
    try:
        got = _run(s, on_step)
    finally:
        timer.cancel()
    assert healed.is_set()
    # the first session ended by a Detach whose answer was lost, the next one told it was
    # gone; the one made then (after any further losses) detached at shutdown
    assert faults.detaches[:2] == [(first, "applied, its answer lost"), (first, "NOT_FOUND")], faults.detaches
    assert faults.detaches[-1] == (manager.session_id, "OK")
    assert manager.lost_requests > 0 and s.kvcoord_preempted > 0  # lost, and recomputed
    oracle.assert_clean()
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:3]]
    with KVCoordClient(still_server.address, timeout=10) as c:
        assert list(c.list_sessions(POOL).sessions) == []  # (the last one detached at shutdown)
        assert list(c.inspect_pool(POOL, all_requests=True).requests) == []
        assert not c.check_pool(POOL).violations
    assert first != manager.session_id
