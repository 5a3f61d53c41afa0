"""bench/vs_vllm_connector.py's differential with KV-connector tokens, with fewer seeds and
steps, so CI keeps it true: vLLM's own KVCacheManager (0.16.0 or 0.33.0, whichever this
venv has) and kvcoord's engine on every layout of bench/vs_vllm.py for that release,
first allocations with external tokens, asynchronous loads landing a step or two later
(``cache_blocks``), failed loads (asynchronous ones part way, at block 0 or, under 0.33,
as a whole: then freed and looked up again; synchronous ones recomputed, or evicted and
failed), under 0.33 each step's new block ids to zero (``take_new_block_ids``, with
asynchronous loads' ``skip_zeroing_group_ids`` and ``record_blocks_for_zeroing`` after a
failed one) and a prefix replay window's calls (``_mark_prefix_replay``: synchronous
loads of the whole sequence, chunks inside the replayed tokens), every answer
identical; where kvcoord refuses loudly
(HIT_BLOCK_TAKEN, UNCOUNTED_BLOCKS) vLLM's manager did that anomaly on the same call (the
bench's full run and its counts are in bench/README.md).

Each release's half runs in its own venv (the other's is skipped):
``scripts/test_vllm.sh -k vs_vllm_connector`` and the same with
``KVCOORD_VLLM_VERSION=0.33.0``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from harness import V033
from kvcoord.engine.invariants import check_pool

ROOT = Path(__file__).resolve().parents[2]
#: seeds and scheduler steps per layout and setting (the bench: 3 x 150)
SEEDS = {"0.16": range(1), "0.33": range(1)}
STEPS = {"0.16": 100, "0.33": 60}
RELEASE = "0.33" if V033 else "0.16"


def _bench() -> ModuleType:
    module = sys.modules.get("vs_vllm_connector")
    if module is None:
        sys.path.insert(0, str(ROOT / "bench"))
        spec = importlib.util.spec_from_file_location(
            "vs_vllm_connector", ROOT / "bench" / "vs_vllm_connector.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["vs_vllm_connector"] = module
        spec.loader.exec_module(module)
    return module


def _layouts(release: str) -> list[str]:
    return list(_bench().layouts(release))


def _cases() -> list[object]:
    return [
        pytest.param(
            release,
            layout,
            marks=pytest.mark.skipif(
                release != RELEASE, reason=f"vLLM {release} only (this venv has another)"
            ),
            id=f"{release}-{layout}",
        )
        for release in ("0.16", "0.33")
        for layout in _layouts(release)
    ]


@pytest.mark.parametrize(("release", "layout"), _cases())
def test_every_answer_with_connector_tokens_equals_vllms(release: str, layout: str) -> None:
    """Hits, new blocks, refusals, free counts, block tables, the free queue's head,
    events and statistics identical at every step, and kvcoord's pool checks clean (the
    bench raises at the first difference, naming it); the runs exercised external
    tokens, asynchronous loads and their landing."""
    bench = _bench()
    every = bench.layouts(release)
    lines: list[str] = []
    totals = bench.check(release, SEEDS[release], STEPS[release], {layout: every[layout]}, out=lines.append)
    t = totals[layout]
    assert t["answers"] > 0 and t["external"] > 0 and t["async"] > 0 and t["cached"] > 0, (t, lines)
    if release == "0.16" and layout == "full16+swa16(w128)":
        # vLLM 0.16's group-by-group adoption handed a hit block to two groups here, and
        # kvcoord refused the same call naming the same block (HIT_BLOCK_TAKEN)
        assert t["shared"] > 0, (t, lines)
    if release == "0.33":
        assert t["shared"] == 0, (t, lines)  # 0.33 touches every hit first
    if layout in ("full16", "swa16(w64)"):
        assert t["failed"] > 0, (t, lines)  # failed asynchronous loads (one group)
        assert t["sync failed"] > 0, (t, lines)  # requests a failed synchronous load voided
        assert t["dropped"] > 0, (t, lines)  # loads failed at block 0: blocks freed, looked up again
    if release == "0.33" and layout == "full16+swa32(w128)":
        assert t["dropped"] > 0, (t, lines)  # a whole load failed (failed_recving) with two groups
    if release == "0.33":
        # new blocks zeroed (zeroing runs, mamba layouts), async loads' groups not zeroed
        assert t["zeroed"] > 0 and t["skip zeroing"] > 0, (t, lines)
        if "mamba" not in layout:  # runs with a prefix replay window
            assert t["replayed"] > 0 and t["inside replay"] > 0 and t["replay dropped"] > 0, (t, lines)
    if release == "0.33" and layout in ("full16", "swa16(w64)", "swa16(w16) r64", "mla16"):
        # an async load failed part way in a zeroing pool: its unwritten blocks recorded again
        assert t["zeroing recorded"] > 0, (t, lines)
    if release == "0.33" and layout in ("full16", "swa16(w64)"):
        assert t["whole sync"] > 0, (t, lines)  # synchronous loads of the whole sequence, replayed


@pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (dense retention is a 0.33 setting)")
def test_dense_retention_leaves_the_same_window_blocks_unhashed_as_vllm_033_and_checks_clean() -> None:
    """bench/vs_vllm.py's "full32+swa16(w16) dense" layout: a 600-token prompt's first
    chunk (512 tokens). A 16-token window needs one 16-token block per 32-token scheduler
    block, so dense retention hashes every other window block. vLLM 0.33.0's manager and
    kvcoord's pool hash the same positions in every group with the same cached counts,
    and check_pool accepts the unhashed ones (it reported each as "is not cached" before)."""
    bench = _bench()
    layout = bench.base.LAYOUTS_033["full32+swa16(w16) dense"]
    tokens = list(range(1000, 1600))
    seen = []
    for side in (bench.VLLM33(layout, 300, False, True, ""), bench.Ours33(layout, 300, False, True, "")):
        side.step_start()
        sync = side.add("a", tokens)
        if sync is not None:
            sync()
        hit, _ids, n = side.lookup("a")
        assert side.admit("a", 512, n, hit, 0) is not None
        pool = side.m if hasattr(side, "m") else side.pool
        managers = pool.coordinator.single_type_managers if hasattr(side, "m") else pool.managers
        blocks = pool.block_pool.blocks
        seen.append(
            [
                (m.num_cached_block["a"], [blocks[b].block_hash is not None for b in table])
                for m, table in zip(managers, side.block_ids("a"), strict=True)
            ]
        )
    assert seen[0] == seen[1]
    assert seen[0][1][0] == 32 and seen[0][1][1][:4] == [False, True, False, True]
    assert check_pool(side.pool).violations == ()
