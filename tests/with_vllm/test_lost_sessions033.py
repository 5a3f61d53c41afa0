"""vLLM 0.33.0's schedulers on kvcoord when the predicted session is lost between steps:
the engine preempts the requests lost and recomputes them, and every request completes
with the tokens of vLLM's own run (0.16.0's are in test_lost_sessions.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import SCHEDULERS, V033, kv_cache_config, make_scheduler, run_workload, vllm_config
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from test_lost_sessions import outputs_by_request

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (this venv has another release)")

STEPS = 120
#: the step before which the session is ended
LOSS_STEP = 40


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_session_ended_between_steps_costs_recomputation(
    kind: str, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before step 40 the server ends the engine's session (another client detaches it,
    as a lease running out would): the Step the manager sends in the background fails,
    the next schedule() preempts every running request (all lost) and recomputes them.
    (Before, RequestsLostError left schedule() and vLLM 0.33's engine core died.)"""
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    asynchronous = kind == "async"
    local = make_scheduler(SCHEDULERS[kind], vllm_config(model_dir, 64, async_scheduling=asynchronous),
                           kv_cache_config("full", 64))  # fmt: skip
    trace, _ = run_workload(local, seed=5, steps=STEPS, async_overlap=asynchronous, aborts=False, drain=True,
                            positional=True)  # fmt: skip
    want = outputs_by_request(trace)
    assert want and all(reason == "length" for _, reason in want.values())

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"lost033-{kind}")
    monkeypatch.setenv("KVCOORD_PREDICT", "1")
    cls = KVCoordAsyncScheduler if asynchronous else KVCoordScheduler
    remote = make_scheduler(cls, vllm_config(model_dir, 64, async_scheduling=asynchronous),
                            kv_cache_config("full", 64))  # fmt: skip
    manager = remote.kv_cache_manager.remote
    ended: list[str] = []

    def on_step(step: int) -> None:
        if step == LOSS_STEP:
            manager.flush()  # nothing in flight: the next Step is the first to fail
            with KVCoordClient(server.address) as other:
                other.detach(manager.session_id)
            ended.append(manager.session_id)
        elif step == LOSS_STEP + 1:
            # the Step sent while applying step 40's outputs fails in the background:
            # wait (bounded) until the manager knows, so the loss is met between steps
            deadline = time.monotonic() + 10.0
            while manager.sender.failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert manager.sender.failure is not None

    try:
        trace, _ = run_workload(remote, seed=5, steps=STEPS, async_overlap=asynchronous, aborts=False,
                                drain=True, positional=True, on_step=on_step)  # fmt: skip
    finally:
        remote.shutdown()
    got = outputs_by_request(trace)
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
    assert ended and manager.session_id != ended[0]  # a new session
    assert manager.lost_requests > 0  # requests were lost
    assert remote.kvcoord_preempted > 0  # and preempted for recomputation
