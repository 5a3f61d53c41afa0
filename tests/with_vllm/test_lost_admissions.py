"""A loss that cuts short the schedule() call that admitted a request to an asynchronous
KV load (the waiting mode: each manager call is answered by the server, so the loss is
met by the next call of the same schedule()).

The call is undone and made again. The request it admitted had been told to the
connector (``update_state_after_alloc``: its load recorded, with the block ids the lost
session held) and, under vLLM 0.33, entered the scheduler's in-flight prefills, whose
reservation the next schedule() asks the manager for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import SCHEDULERS, kv_cache_config, make_scheduler
from kvcoord.service.testing import InProcessServer
from test_lost_transfers import _config, _guarded_run


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_loss_that_cuts_short_the_admission_of_a_load(
    kind: str, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session is ended on the server (three times) just after a schedule() call
    admitted a request to an asynchronous load, before the call's next manager call.
    Every request completes with the tokens of vLLM's own run, and no block a transfer
    still uses is given to another request. (Before, under vLLM 0.33, the request undone
    stayed among the in-flight prefills: the next schedule() asked the server about a
    request it no longer held, and NOT_FOUND was taken for a pool gone, again and again
    until KVCOORD_MAX_OUTAGE.)"""
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    want, _ = _guarded_run(
        make_scheduler(SCHEDULERS[kind], _config(model_dir, kind), kv_cache_config("full", 64))
    )
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"lost-admission-{kind}")
    monkeypatch.setenv("KVCOORD_PREDICT", "0")
    monkeypatch.setenv("KVCOORD_MAX_OUTAGE", "5")
    cls = KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler
    scheduler = make_scheduler(cls, _config(model_dir, kind), kv_cache_config("full", 64))
    connector = scheduler.connector
    state = {"step": 0, "last": 5, "undone": 0}  # (the first loss at step 20 or later)
    losses: list[tuple[int, str]] = []
    cut: list[bool] = []  # per loss: the call it was met in was undone
    after_alloc = connector.update_state_after_alloc

    def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
        after_alloc(request, blocks, num_external_tokens)
        rid = request.request_id
        if rid in connector.loading and len(losses) < 3 and state["step"] >= state["last"] + 15:
            manager = scheduler.kv_cache_manager.remote
            manager.client.detach(manager.session_id, manager.keeper.fence)
            losses.append((state["step"], rid))
            state["last"], state["undone"] = state["step"], scheduler.kvcoord_undone

    connector.update_state_after_alloc = update_state_after_alloc

    def on_step(step: int) -> None:
        if len(cut) < len(losses):
            cut.append(scheduler.kvcoord_undone > state["undone"])
        state["step"] = step

    got, guard = _guarded_run(scheduler, on_step)
    assert not guard.overlaps, (
        f"blocks in transfer given to other requests (request, block, transfer's): {guard.overlaps[:5]}"
    )
    assert len(losses) == 3 and cut == [True] * 3, (losses, cut)  # each admission's call undone
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
