"""A refusal about a request, met by vLLM's scheduler on kvcoord, is not taken for a
pool gone from the server.

A predicted session's mirror answers each call as the server will, refusals included.
It refused a request it does not hold with a plain ``NotFoundError``, which the
scheduler's outage loop reads as "the pool is gone" (a server restarted empty): it
created the pool again (the server answered ALREADY_EXISTS) and tried again at once,
without a pause, until ``KVCOORD_MAX_OUTAGE``. The server answers the same refusal
``RequestUnknownError`` (REQUEST_UNKNOWN), as the mirror now does; the scheduler waits
for it as for any outage (``KVCOORD_MAX_OUTAGE`` at most)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import kv_cache_config, make_scheduler, run_workload, vllm_config
from kvcoord.service.testing import InProcessServer


def test_a_request_the_mirror_does_not_hold_is_not_a_lost_pool(
    model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror forgets a running request behind the scheduler's back (as a bug would):
    the next schedule() meets the refusal, undoes the call (the request it allocated for
    is preempted), waits as for an outage and makes the call again, which recovers; it
    never asks for the pool to be created again (before: once per refusal, then at once
    again)."""
    from kvcoord.client.vllm_scheduler import KVCoordScheduler

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", "refused-request")
    monkeypatch.setenv("KVCOORD_PREDICT", "1")
    scheduler = make_scheduler(
        KVCoordScheduler, vllm_config(model_dir, 64, async_scheduling=False), kv_cache_config("full", 64)
    )
    adapter = scheduler.kv_cache_manager
    created: list[int] = []
    monkeypatch.setattr(adapter, "create_pool_again", lambda: bool(created.append(1)) or True)
    forgotten: list[str] = []

    def on_step(step: int) -> None:
        if step == 10 and not forgotten:
            engine = adapter.remote.mirror.engine
            rid = next(r.request_id for r in scheduler.running if r.request_id in engine.requests)
            engine.free(rid)
            forgotten.append(rid)

    try:
        run_workload(scheduler, seed=3, steps=40, async_overlap=False, aborts=False, on_step=on_step)
    finally:
        scheduler.shutdown()
    assert forgotten and scheduler.kvcoord_outages >= 1, (forgotten, scheduler.kvcoord_outages)
    assert created == [], f"the pool was created again {len(created)} times for a request's refusal"
