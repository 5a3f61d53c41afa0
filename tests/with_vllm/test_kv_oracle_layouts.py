"""Self-test of the KV oracle's chunked-local and mamba checks (kv_oracle.py): clean on
vLLM's own manager (chunked local attention with and without a KV connector; mamba
"none" and "align", with EAGLE drafts beside "align" under 0.33), and catching a
planted swap of one group's blocks between two requests (the other groups intact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import SCHEDULERS, V033, make_scheduler, run_workload
from kv_oracle import KVOracle
from layouts_support import group_of, layout_configs, plant_group_swap

#: (kind, layout, speculative, connector): what the vLLM release runs
CASES = [
    ("sync", "full+chunked", None, None), ("async", "full+chunked", None, None),
    ("sync", "full+chunked", None, "LoadedHalfConnector"), ("sync", "full+mamba", None, None),
    # (vLLM 0.16 caches a resumed request's unaligned mamba state under a later
    # position, its defect: the oracle sees those hits read a state not theirs)
    pytest.param("sync", "full+mamba-align", None, None, marks=pytest.mark.xfail(
        not V033, reason="vLLM 0.16's unaligned resume in mamba align mode", strict=True)),
]  # fmt: skip
CASES_033 = [
    ("sync", "full+chunked", None, "AsyncLoadsConnector"),  # (0.16's asynchronous loads take one group)
    ("async", "full+mamba", None, None), ("async", "full+mamba-align", None, None),
    ("sync", "full+mamba-align", "eagle", None), ("async", "full+mamba-align", "eagle", None),
    ("sync", "full+mamba", "eagle", None), ("sync", "full+mamba-align", "ngram", None),
    ("sync", "full+mamba-align", None, "AsyncLoadsConnector"), ("sync", "full+mamba", None, "LoadedHalfConnector"),
]  # fmt: skip


def _run(s: Any, seed: int, steps: int = 120) -> dict[str, int]:
    try:
        _, counts = run_workload(s, seed=seed, steps=steps, async_overlap=s.scheduler_config.async_scheduling,
                                 aborts=False, drain=True, positional=True)  # fmt: skip
    finally:
        s.shutdown()
    return counts


@pytest.mark.parametrize(("kind", "layout", "speculative", "connector"), CASES + (CASES_033 if V033 else []))
def test_clean_on_vllms_own_manager(
    kind: str, layout: str, speculative: str | None, connector: str | None, model_dir: Path
) -> None:
    cfg, kv = layout_configs(layout, model_dir, 48, asynchronous=kind == "async", speculative=speculative,
                             connector=connector)  # fmt: skip
    s = make_scheduler(SCHEDULERS[kind], cfg, kv)
    oracle = KVOracle(s)
    counts = _run(s, 11)
    print(oracle.summary(), counts)
    oracle.assert_clean()
    # (the async scheduler with drafts: the mamba states' positions are the worker's)
    assert oracle.skipped_groups == ([1] if kind == "async" and speculative and "mamba" in layout else [])
    assert counts["preempted"] > 0
    if "mamba" in layout and not oracle.skipped_groups:
        assert oracle.mamba_reads > 100
    if connector:
        assert oracle.loads_written > 3


@pytest.mark.skipif(not V033, reason="vLLM 0.33's postprocess_mamba (0.16's mamba align is its defect's)")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_clean_with_drafts_beside_mamba_align_under_pressure(seed: int, model_dir: Path) -> None:
    """EAGLE drafts beside a mamba "align" group, 32 blocks and prefix-cache resets:
    requests preempted and resumed hit block-boundary states the runner copied there
    after accepting drafts (the oracle models that copy: without it, 5 of these 6 runs
    and seeds 1-3 at 40 blocks flagged vLLM's own manager)."""
    for blocks in (32, 40):
        cfg, kv = layout_configs(
            "full+mamba-align", model_dir, blocks, asynchronous=False, speculative="eagle"
        )
        s = make_scheduler(SCHEDULERS["sync"], cfg, kv)
        oracle = KVOracle(s)
        try:
            _, counts = run_workload(s, seed=seed, steps=100, async_overlap=False, aborts=False, drain=True,
                                     positional=True, extras=frozenset({"resets"}))  # fmt: skip
        finally:
            s.shutdown()
        oracle.assert_clean()
        assert oracle.mamba_reads > 500 and counts["preempted"] > 20 and counts["hit_tokens"] > 0


@pytest.mark.parametrize(
    ("layout", "spec_class"),
    [
        ("full+chunked", "ChunkedLocalAttentionSpec"),
        ("full+mamba", "MambaSpec"),
        ("full+mamba-align", "MambaSpec"),
    ],
)
def test_catches_one_groups_blocks_swapped(layout: str, spec_class: str, model_dir: Path) -> None:
    cfg, kv = layout_configs(layout, model_dir, 64, asynchronous=False)
    s = make_scheduler(SCHEDULERS["sync"], cfg, kv)
    done = plant_group_swap(s, group_of(s, spec_class))
    oracle = KVOracle(s)
    _run(s, 11)
    print(done, oracle.summary(), oracle.violations[:3])
    assert done, "no fault planted"
    assert oracle.violations, "the oracle missed the planted fault"
    assert all(v[3] == group_of(s, spec_class) for v in oracle.violations[:1] if isinstance(v[3], int))
