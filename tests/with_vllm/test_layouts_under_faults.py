"""Layouts the KV oracle had not run under faults (layouts_faults.py drives them): a
speculative decoder (EAGLE) beside a mamba group, vLLM 0.33's mamba layouts ("none",
"align", "align" with a prefill checkpoint block), chunked local attention with a KV
connector whose transfers span steps (and, on 0.33, predicted with the server SIGKILLed at
a prefill's Step, before it is sent or after it was answered; or its session ended and the
pool taken by a second engine for a while), and two engines sharing one pool
(KVCOORD_EXCLUSIVE=0) on full+SWA and chunked-local layouts. Each run: every position
a scheduled request reads holds its own KV (the oracle), every request completes with
vLLM's own tokens (and, under network faults or SIGKILLs, every decision is vLLM's),
no UNKNOWN/INTERNAL error anywhere, CheckPool finds nothing and every block is free
once the engines shut down. A few cheap guards of the clean matrix (the review report
lists the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import V033
from layouts_faults import Case, names_a_failed_call, run_case

GUARDS_033 = [
    Case("sync", "full+mamba-align", "predicted", "detach", 1, speculative="eagle"),
    Case("sync", "full+mamba", "shared", "lostalloc", 1, speculative="eagle"),
    Case("sync", "full+mamba-align", "exclusive", "emptied", 12, blocks=40),
    Case("sync", "full+mamba-ckpt-align", "predicted", "detach", 6),
    Case("sync", "partial", "predicted", "lostalloc", 13, blocks=120),
    Case("sync", "full+chunked", "predicted", "detach", 2, connector="SlowTransfersConnector"),
    Case("sync", "full+chunked", "shared", "lostalloc", 3, engines=2),
    Case("sync", "full+chunked", "predicted", "killstep", 11),
    Case("async", "full+chunked", "predicted", "killstep", 12, connector="SlowTransfersConnector"),
    Case("sync", "full+chunked", "predicted", "takeover", 11),
]
GUARDS_016 = [
    Case("sync", "full+chunked", "predicted", "detach", 4, connector="LoadedHalfConnector"),
    Case("sync", "full+mamba", "exclusive", "lost", 4, speculative="eagle"),
    Case("sync", "full+chunked", "shared", "detach", 5, engines=2),
]


@pytest.mark.parametrize("case", GUARDS_033 if V033 else GUARDS_016, ids=repr)
def test_a_layout_under_faults_reads_only_its_own_kv(case: Case, model_dir: Path, tmp_path: Path) -> None:
    problems = run_case(case, model_dir, tmp_path)
    assert not problems, "\n".join(problems)
    met = case.injected["met"][0]
    assert met or case.injected["kills"], case.injected  # the fault happened
    if case.event == "killstep":  # every kill it armed, half of them after the answer
        assert case.injected["kills"] == len(met) == 4, case.injected
        assert case.injected["counts"][0]["dropped"] == 2, case.injected
    for e, r in enumerate(case.results):
        summary = r["oracle"].summary()
        assert summary["positions"] > 1000, summary
        if "mamba" in case.layout and "ckpt" not in case.layout:
            assert summary["mamba_reads"] > 100, summary
        if case.engines > 1:
            assert summary["foreign_reads"] > 0, summary  # an engine read the other's KV
        if case.event in ("lost", "emptied") or (
            case.event in ("detach", "takeover") and e == 0
        ):  # (only engine 0 detached)
            assert r["manager"].lost_requests > 0


@pytest.mark.skipif(not V033, reason="vLLM 0.33's mamba pools admit one session (0.16's: several)")
def test_a_second_engine_on_a_mamba_pool_is_refused_loudly(model_dir: Path, tmp_path: Path) -> None:
    """vLLM 0.33: a mamba pool admits one session at a time; a second engine on it
    (KVCOORD_EXCLUSIVE=0) fails at start with a typed error, not later."""
    from kvcoord.client.errors import PoolBusyError

    case = Case("sync", "full+mamba-align", "shared", "none", 1, engines=2)
    with pytest.raises(PoolBusyError, match="has mamba groups"):
        run_case(case, model_dir, tmp_path)


# vLLM 0.33's own defect, which kvcoord reproduces (its decisions are vLLM's): a request
# whose asynchronous load the connector reports failed is recomputed (computed tokens 0,
# blocks freed, WAITING or PREEMPTED) but stays in the scheduler's _inflight_prefills; when
# it does not fit at once, the reservation it counts for itself (its own remaining blocks)
# keeps it from ever fitting, and at the head of kv_holding_waiting it stops every
# schedule(): nothing runs again. Under kvcoord with lost Steps (full + chunked, predicted,
# FailedRecvingConnector, 48 blocks) the recomputations put it in reach in most runs; with
# the vLLM 0.33 venv's python: tests/with_vllm/layouts_matrix.py
# 'Case("sync", "full+chunked", "predicted", "lost", 7, connector="FailedRecvingConnector")'


@pytest.mark.skipif(not V033, reason="vLLM 0.33's in-flight prefill reservations")
def test_vllm_033s_own_scheduler_stalls_on_a_failed_async_load(model_dir: Path) -> None:
    """vLLM's own manager, no kvcoord, no fault: full + chunked local attention in 32
    blocks, one asynchronous load in three reported failed (FailedRecvingConnector). The
    run never drains: a request left in _inflight_prefills with nothing computed heads the
    queue. (When vLLM fixes this, this test fails: drop it.)"""
    from harness import SCHEDULERS, make_scheduler, run_workload
    from layouts_support import layout_configs

    cfg, kv = layout_configs(
        "full+chunked", model_dir, 32, asynchronous=False, connector="FailedRecvingConnector"
    )
    s = make_scheduler(SCHEDULERS["sync"], cfg, kv)
    try:
        run_workload(s, seed=3, steps=90, async_overlap=False, aborts=False, drain=True, positional=True)
        stuck = [r for r in s.requests.values() if r in s._inflight_prefills and r.num_computed_tokens == 0]
        assert s.requests and stuck and not s.running, [
            (r.request_id, str(r.status)) for r in s.requests.values()
        ]
    finally:
        s.shutdown()


def test_the_verdict_tells_a_failed_call_from_a_refused_connection() -> None:
    # what the session keeper logged in CI while a killstep's server restarted (a renewal
    # met nothing listening): the transport's "last error", not a server's failure
    refused = (
        "session renewal failed: UNAVAILABLE: failed to connect to all addresses; last error: "
        "UNKNOWN: ipv4:127.0.0.1:28323: Failed to connect to remote host: Connection refused"
    )
    assert not names_a_failed_call(refused)
    assert names_a_failed_call("step failed: UNKNOWN: Exception calling application: KeyError")
    assert names_a_failed_call("allocate failed: INTERNAL: journal write")
    assert names_a_failed_call(refused + " (then UNKNOWN: Exception iterating responses)")
