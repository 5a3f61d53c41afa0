"""The differential check of bench/vs_vllm.py against vLLM 0.33.0's own KVCacheManager,
with fewer seeds and steps, so CI keeps it true: every layout, prefix caching on and
off, EAGLE off, with look-ahead hashes and with vLLM 0.33's trailing-block drop, every
answer identical (the bench's full run and its counts are
in bench/README.md).

Runs in the vLLM 0.33.0 venv only (``KVCOORD_VLLM_VERSION=0.33.0 scripts/test_vllm.sh
-k vs_vllm033``); under 0.16.0 the same bench's own check (``--check-only``) is the
differential run.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from harness import V033

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (this venv has another release)")

ROOT = Path(__file__).resolve().parents[2]
#: seeds and scheduler steps per layout, caching and EAGLE setting (the bench: 3 x 150)
SEEDS, STEPS = 2, 100


def _load(name: str, path: Path) -> ModuleType:
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def _bench() -> ModuleType:
    return _load("vs_vllm", ROOT / "bench" / "vs_vllm.py")


def _layouts() -> list[str]:
    return list(_bench().LAYOUTS_033)


@pytest.mark.parametrize("layout", _layouts())
def test_every_answer_equals_vllm_033(layout: str) -> None:
    """Hits, boundaries, new blocks, refusals, free counts, block tables, the free
    queue's head, events and statistics: identical at every step (the bench raises at
    the first difference, naming it)."""
    bench = _bench()
    lines: list[str] = []
    counts = bench.check033(SEEDS, STEPS, {layout: bench.LAYOUTS_033[layout]}, out=lines.append)
    identical = [line for line in lines if line.startswith("identical")]
    skipped = [
        m.group(0)
        for line in lines
        if line.startswith("skipped") and (m := re.search(r"caching=\w+ eagle=\w+( drop=[a-z]+)?", line))
    ]
    # caching on: EAGLE off, look-ahead hashes, the trailing-block drop in the first group
    # and in every group; caching off: EAGLE off and on (the drop). The profile refuses
    # EAGLE's drop beside a mamba group (0.33 moves its checkpoints back a block; with
    # caching off only a prefill checkpoint block's), on a chunked-local group (vLLM
    # asserts it away) and on a window of another block size than the LCM
    expect_skipped = []
    if "mamba" in layout:
        expect_skipped = ["caching=True eagle=True drop=first", "caching=True eagle=True drop=all"]
        if "ckpt" in layout:
            expect_skipped.append("caching=False eagle=True")
    elif "chunked" in layout or layout.startswith("full32+swa16") or layout == "full16+full32+swa16(w64)":
        expect_skipped = ["caching=True eagle=True drop=all"]
    assert skipped == expect_skipped, lines
    assert len(identical) == (6 - len(expect_skipped)) * SEEDS, lines
    drops = [line for line in identical if " drop=" in line]
    assert len(drops) == (2 - sum(" drop=" in s for s in expect_skipped)) * SEEDS, lines
    assert counts[layout] > 0


def _vllm_round_down(delayed: bool) -> dict[str, Any]:
    """tests/conformance/test_differential_033.py's look-ahead scenario on vLLM 0.33.0."""
    side = _bench().VLLM033([("full", {}), ("swa32", {"sliding_window": 128})], 40, True, True)
    prompt = list(range(1000, 1064))
    side.add("a", prompt)
    hit, _ids, n = side.lookup("a")
    out = side.m.allocate_slots(
        side.reqs["a"], 64, n, hit, delay_cache_blocks=delayed, full_sequence_must_fit=True
    )
    assert out is not None
    if delayed:
        assert side.events() == []
        side.cache_blocks("a", 64)
    stored = [(e[9], len(e[1]), e[12]) for e in side.events() if e[0] == "BlockStored"]
    side.free("a")
    return {
        "new": [list(x) for x in out.get_block_ids(allow_none=False)],
        "stored": stored,
        "free_queue_head": side.free_head(12),
        "num_free": side.num_free(),
    }


@pytest.mark.parametrize("delayed", [False, True], ids=["allocate_slots", "cache_blocks"])
def test_the_pinned_answers_are_vllm_033s(delayed: bool) -> None:
    """The answers tests/conformance/test_differential_033.py pins are vLLM 0.33.0's."""
    pinned = _load(
        "conformance_differential_033", ROOT / "tests" / "conformance" / "test_differential_033.py"
    )
    assert _vllm_round_down(delayed) == pinned.VLLM_LOOKAHEAD_ROUND_DOWN


def test_the_pinned_mamba_speculative_answers_are_vllm_033s() -> None:
    """tests/conformance/test_differential_033.py's MTP-on-mamba scenario, on vLLM 0.33.0."""
    pinned = _load(
        "conformance_differential_033", ROOT / "tests" / "conformance" / "test_differential_033.py"
    )
    side = _bench().VLLM033([("full", {}), ("mamba_align", {})], 40, True, True)
    assert pinned.mamba_speculative_scenario(side) == pinned.VLLM_MAMBA_SPECULATIVE


def _drop_once_scenario(side: Any, evict: tuple[tuple[int, int], ...]) -> tuple[int, list[list[int]]]:
    """A prompt of 10 blocks cached in three attention groups (full attention, windows of
    32 and 64 tokens), the blocks at ``evict`` ((group, index) pairs) evicted, then a
    longer prompt's lookup: its hit tokens and block ids."""
    prompt = list(range(2000, 2160))
    for rid, tokens in (("a", prompt), ("b", [*prompt, *range(5000, 5040)])):
        sync = side.add(rid, tokens)
        if sync is not None:
            sync()
        hit, ids, n = side.lookup(rid)
        if rid == "b":
            return n, ids
        assert side.admit(rid, len(tokens), n, hit, 0) is not None
        side.cache_blocks(rid, len(tokens))
        table = side.block_ids(rid)
        side.free(rid)
        ids_out = {table[g][i] for g, i in evict}
        (side.m if hasattr(side, "m") else side.pool).evict_blocks(ids_out)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("evict", [(), ((1, 4),), ((1, 4), (2, 5)), ((1, 3), (2, 5))])
def test_an_eagle_group_drops_once_per_candidate_length(evict: tuple[tuple[int, int], ...]) -> None:
    """vLLM 0.33's hybrid search drops EAGLE's block at most once per candidate length
    per attention group (no repeated drop, 0.16's "spiral"): with block 4 of the 32-token
    window and block 5 of the 64-token window evicted, the 64-token window cuts the hit
    to 64 tokens, and the 32-token window, already dropped at that length, keeps it
    (dropping again would peek at its evicted block 4 and end at 48). kvcoord's
    vllm-0.33 pool answers as vLLM 0.33.0's own manager in each case."""
    bench = _bench()
    layout = [
        ("full", {}),
        ("swa", {"sliding_window": 32, "retention": None}),
        ("swa", {"sliding_window": 64}),
    ]
    theirs = _drop_once_scenario(bench.VLLM033(layout, 64, True, True, "all"), evict)
    ours = _drop_once_scenario(bench.Ours033(layout, 64, True, True, "all"), evict)
    assert ours == theirs
    if evict == ((1, 4), (2, 5)):
        assert theirs[0] == 64  # (the case a repeated drop answers 48)
