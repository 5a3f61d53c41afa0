"""vLLM 0.33's deferred asynchronous loads (``Scheduler.deferred_loads``) never reach kvcoord.

vLLM 0.33 may admit a request to an asynchronous KV load (blocks allocated, status
WAITING_FOR_REMOTE_KVS) and tell the connector only later, in ``update_from_output``
(``_drain_deferred_loads``, which asks the manager's ``get_blocks`` then). It does so only
when ``defer_async_loads`` is set, which 0.33.0 sets for a KV consumer with overlapping
steps *and* a HiSparse host pool. kvcoord's recovery from a lost session knows an admitted
load only by the request's status, not by that later start, so the plug-in refuses such an
engine at start: these tests pin that kvcoord's own configurations never defer a load, and
that a scheduler whose load fence is on is refused, whatever set it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import SCHEDULERS, V033, kv_cache_config, make_scheduler, run_workload, vllm_config

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (0.16 has no deferred loads)")


def _config(model_dir: Path) -> Any:
    """The configuration test_lost_transfers runs asynchronous loads under: the async
    scheduler (overlapping steps) and a KV consumer whose loads span several steps."""
    return vllm_config(model_dir, 64, async_scheduling=True, connector="SlowTransfersConnector")


def test_kvcoords_async_configuration_frees_late_but_never_defers_a_load(model_dir: Path) -> None:
    """On vLLM's own AsyncScheduler with that configuration, steps overlap (frees are
    deferred: a later step is scheduled before the earlier one is processed) and loads
    are asynchronous, yet no load is ever deferred: ``defer_async_loads`` needs a HiSparse
    host pool too."""
    s = make_scheduler(SCHEDULERS["async"], _config(model_dir), kv_cache_config("full", 64))
    assert s.defer_block_free and not s.defer_async_loads
    seen = {"gap": 0, "deferred": 0}
    schedule = s.schedule

    def watched() -> Any:
        out = schedule()
        seen["gap"] = max(seen["gap"], s.sched_step_seq - s.processed_step_seq)
        seen["deferred"] = max(seen["deferred"], len(s.deferred_loads))
        return out

    s.schedule = watched  # type: ignore[method-assign]
    run_workload(s, seed=11, steps=80, async_overlap=True, aborts=False, drain=True)
    assert s.connector.counts["async loads"] > 3, s.connector.counts
    assert seen == {"gap": seen["gap"], "deferred": 0} and seen["gap"] > 0, seen


@pytest.mark.parametrize("predict", ["0", "1"])
def test_a_hisparse_host_pool_is_refused_by_the_scheduler_in_both_modes(
    predict: str, model_dir: Path, server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The configuration that makes vLLM 0.33 defer loads: KVCoordAsyncScheduler refuses
    it at start, waiting and predicted sessions alike, before connecting."""
    from kvcoord.client.vllm033 import Unsupported033Error
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"deferred-loads-hisparse-{predict}")
    monkeypatch.setenv("KVCOORD_PREDICT", predict)
    kv = kv_cache_config("full", 64)
    kv.hisparse_host_num_blocks = 8
    with pytest.raises(Unsupported033Error, match="HiSparse host pool"):
        make_scheduler(KVCoordAsyncScheduler, _config(model_dir), kv)


@pytest.mark.parametrize("predict", ["0", "1"])
def test_a_scheduler_whose_load_fence_is_on_is_refused_whatever_set_it(
    predict: str, model_dir: Path, server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM scheduler that defers asynchronous loads without a HiSparse host pool (a
    0.33.x whose condition differs, or a subclass: here one that sets the flag) is
    refused at start too, naming ``defer_async_loads``. (Before, only the HiSparse pool
    was checked: such an engine started, and a session lost between a deferred load's
    admission and its start had the connector told, at the drain, to load into the empty
    table of a request the pool no longer held.)"""
    from kvcoord.client.vllm033 import Unsupported033Error
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler

    class FencedLoads(SCHEDULERS["async"]):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.defer_async_loads = True

    class FencedOnKVCoord(KVCoordAsyncScheduler, FencedLoads):  # type: ignore[misc,valid-type]
        pass

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"deferred-loads-fenced-{predict}")
    monkeypatch.setenv("KVCOORD_PREDICT", predict)
    with pytest.raises(Unsupported033Error, match="defer_async_loads"):
        make_scheduler(FencedOnKVCoord, _config(model_dir), kv_cache_config("full", 64))
