"""vLLM 0.33: a lost session first met by ``_connector_finished`` (update_from_output's
free of a finished request asks the manager for the blocks its computed tokens fill,
``get_block_ids_for_computed_tokens``: a round trip in the waiting mode). Every manager
call update_from_output makes keeps a loss for the next schedule(); this one raised
RequestsLostError out of update_from_output, which ends vLLM's engine core. Now the
loss is kept, the request (lost with its session) has no blocks to send, and the
workload runs to its end with vLLM's own tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import SCHEDULERS, V033, kv_cache_config, make_scheduler, run_workload, vllm_config
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from test_lost_sessions import outputs_by_request

pytestmark = pytest.mark.skipif(
    not V033, reason="vLLM 0.33's call (0.16 has no get_block_ids_for_computed_tokens)"
)


def _run(s: Any, on_step: Any = None) -> Any:
    try:
        trace, _ = run_workload(
            s, seed=11, steps=80, async_overlap=s.scheduler_config.async_scheduling, aborts=False, drain=True,
            positional=True, on_step=on_step,
        )  # fmt: skip
    finally:
        s.shutdown()
    return outputs_by_request(trace)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_loss_first_met_by_connector_finished_is_kept_for_the_scheduler(
    kind: str, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    def config() -> Any:
        return vllm_config(
            model_dir, 64, async_scheduling=kind == "async", connector="SlowTransfersConnector"
        )

    want = _run(make_scheduler(SCHEDULERS[kind], config(), kv_cache_config("full", 64)))
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"connector-finished-loss-{kind}")
    monkeypatch.setenv("KVCOORD_PREDICT", "0")
    cls = KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler
    s = make_scheduler(cls, config(), kv_cache_config("full", 64))
    adapter = s.kv_cache_manager
    state = {"step": 0, "ended": 0}
    ask = adapter.get_block_ids_for_computed_tokens

    def ending(request_id: str, num_computed_tokens: int) -> Any:
        # the session ends on the server (a lease run out) just before the call
        if state["step"] >= 20 and not state["ended"]:
            state["ended"] = state["step"]
            with KVCoordClient(server.address) as other:
                other.detach(adapter.remote.session_id)
        return ask(request_id, num_computed_tokens)

    adapter.get_block_ids_for_computed_tokens = ending

    def on_step(step: int) -> None:
        state["step"] = step

    got = _run(s, on_step)  # (raised RequestsLostError out of update_from_output)
    assert state["ended"], "no finished request after step 20"
    assert s.kvcoord_preempted > 0, "the loss was never acted on"
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
