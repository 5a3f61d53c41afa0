"""Self-test of the KV oracle (kv_oracle.py): clean on vLLM's own manager (sync/async, no connector /
a slow asynchronous-transfer connector, memory pressure, prefix sharing), and it catches
planted faults (two requests' block tables swapped once; a request's blocks freed
while it keeps its computed tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import SCHEDULERS, kv_cache_config, make_scheduler, run_workload, vllm_config
from kv_oracle import KVOracle
from layouts_support import plant_group_swap


def _run(sched: Any, seed: int = 11, steps: int = 160) -> Any:
    asynchronous = sched.scheduler_config.async_scheduling
    try:
        trace, counts = run_workload(sched, seed=seed, steps=steps, async_overlap=asynchronous, aborts=False,
                                     drain=True, positional=True)  # fmt: skip
    finally:
        sched.shutdown()
    return counts


# (a connector's asynchronous loads on full attention only: vLLM 0.16's take one group)
@pytest.mark.parametrize(
    ("connector", "layout"), [(None, "full"), (None, "full+swa"), ("SlowTransfersConnector", "full")]
)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_clean_on_vllms_own_manager(kind: str, connector: Any, layout: str, model_dir: Path) -> None:
    cfg = vllm_config(model_dir, 64, async_scheduling=kind == "async", connector=connector)
    s = make_scheduler(SCHEDULERS[kind], cfg, kv_cache_config(layout, 64))
    oracle = KVOracle(s)
    counts = _run(s)
    print(oracle.summary(), counts)
    oracle.assert_clean()
    assert counts["preempted"] > 0 and counts["hit_tokens"] > 0
    if connector:
        assert oracle.loads_written > 5


def _plant_swap(s: Any) -> dict[str, Any]:
    """Once: two running requests of different prefixes get each other's whole tables."""
    return plant_group_swap(s, None)


def _plant_free(s: Any) -> dict[str, Any]:
    """Once: a running request's blocks freed and fresh ones given (it keeps its
    computed tokens) -- the known bug's shape."""
    schedule = s.schedule
    done: dict[str, Any] = {}

    def freeing() -> Any:
        if not done and s.running:
            victims = [r for r in s.running if r.num_computed_tokens >= 48 and not r.is_prefill_chunk]
            if victims:
                r = victims[0]
                s.kv_cache_manager.free(r)
                got = s.kv_cache_manager.allocate_slots(r, r.num_computed_tokens)
                if got is not None:
                    done["rid"] = r.request_id
                    s.running.remove(r)  # resumed as preempted-and-kept, so the worker gets the new table
                    s.running.append(r)
                    s._kvoracle_resume = r.request_id
        out = schedule()
        rid = getattr(s, "_kvoracle_resume", None)
        if rid is not None:
            s._kvoracle_resume = None
            c = out.scheduled_cached_reqs
            if rid in c.req_ids:
                i = c.req_ids.index(rid)
                c.resumed_req_ids = set(c.resumed_req_ids) | {rid}
                c.new_block_ids[i] = s.kv_cache_manager.get_block_ids(rid)
            else:
                done.pop("rid", None)
        return out

    s.schedule = freeing
    return done


@pytest.mark.parametrize("plant", ["swap", "free"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_catches_a_planted_fault(kind: str, plant: str, model_dir: Path) -> None:
    cfg = vllm_config(model_dir, 64, async_scheduling=kind == "async")
    s = make_scheduler(SCHEDULERS[kind], cfg, kv_cache_config("full", 64))
    done = (_plant_swap if plant == "swap" else _plant_free)(s)
    oracle = KVOracle(s)
    _run(s)
    print(done, oracle.summary(), oracle.violations[:3])
    assert done, "no fault planted"
    assert oracle.violations, "the oracle missed the planted fault"
