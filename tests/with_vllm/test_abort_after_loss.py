"""A client's abort (vLLM's EngineCore.abort_requests -> scheduler.finish_requests, which
the engine core calls between steps: client disconnects, and every stop-string finish
the frontend detects) that is the first call to meet a lost session. The plug-in's rule
is that a lost session costs recomputation, never the engine; here RequestsLostError
escapes finish_requests (vLLM's engine core busy loop dies on any exception) and the
aborted request is left half-finished (out of the queues, not freed, not reported).
Now the loss is kept for the next schedule(), which recovers from it, and the workload
runs to its end."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import kv_cache_config, make_scheduler, run_workload, vllm_config
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from vllm.v1.request import RequestStatus


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_abort_that_meets_a_lost_session_does_not_raise(
    kind: str, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_PREDICT", "1")
    cls = KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler
    met: list[tuple[str, BaseException | None]] = []
    # the loss must still be unmet when the abort comes (timing of the sender thread)
    for attempt in range(6):
        monkeypatch.setenv("KVCOORD_POOL", f"abort-after-loss-{kind}-{attempt}")
        config = vllm_config(
            model_dir, 64, async_scheduling=kind == "async", connector="SlowTransfersConnector"
        )
        s = make_scheduler(cls, config, kv_cache_config("full", 64))
        manager = s.kv_cache_manager.remote
        at = 20 + attempt

        def on_step(step: int, s=s, manager=manager, at=at) -> None:
            if step == at:
                with KVCoordClient(server.address) as other:
                    other.detach(manager.session_id)  # the session ends on the server (e.g. lease ran out)
            elif step == at + 1 and not met:
                manager.sender.settle()  # the Step sent in the background has answered (failed)
                if manager.sender.failure is None or s.kv_cache_manager.lost:
                    return  # met already (by update_from_output): not this case
                victim = next(r for r in s.running if s.kv_cache_manager.get_block_ids(r.request_id)[0])
                try:
                    s.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)  # client went away
                except BaseException as err:  # noqa: BLE001
                    met.append((victim.request_id, err))
                    raise
                assert victim.is_finished() and victim not in s.running
                met.append((victim.request_id, None))

        ended: BaseException | None = None
        try:
            run_workload(
                s,
                seed=11,
                steps=40,
                async_overlap=kind == "async",
                aborts=False,
                positional=True,
                on_step=on_step,
            )
        except BaseException as err:  # noqa: BLE001
            ended = err
        finally:
            try:
                s.shutdown()
            except BaseException:  # noqa: BLE001
                pass
        if met:
            break
    assert met, "the loss was always met before the abort (no case made)"
    rid, err = met[0]
    assert err is None, f"scheduler.finish_requests({rid!r}, FINISHED_ABORTED) raised {err!r}"
    assert ended is None, f"the workload after the abort raised {ended!r}"
