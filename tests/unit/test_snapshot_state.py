"""A pool's state as a value (engine/state.py): exported and imported at every few
calls of each conformance trace, the pool goes on answering exactly as vLLM did, and
the imported pool's observable state equals the exported one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cbor2
import pytest
from kvcoord.conformance import load_trace, replay
from kvcoord.conformance.target import LocalTarget
from kvcoord.conformance.trace import config_from_trace
from kvcoord.engine import KVCachePool
from kvcoord.engine.state import STATE_VERSION, StateError, export_state, import_state

DATA = Path(__file__).resolve().parents[1] / "conformance" / "data"
TRACES = sorted(p.stem for p in DATA.glob("*.jsonl"))


def round_trip(pool: KVCachePool) -> KVCachePool:
    """Export, encode as CBOR (plain values only: anything else fails to encode),
    decode and import."""
    value = cbor2.loads(cbor2.dumps(export_state(pool)))
    return import_state(pool.config, value)


class ReloadingTarget(LocalTarget):
    """Replaces its pool by an exported-and-imported copy every ``every`` calls."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
        self.calls = 0
        self.reloads = 0

    def open(self, trace_config: dict[str, Any]) -> None:
        super().open(trace_config)
        self.config = config_from_trace(trace_config)

    def _p(self) -> KVCachePool:
        pool = super()._p()
        self.calls += 1
        if self.calls % self.every == 0:
            copy = round_trip(pool)
            assert copy.snapshot() == pool.snapshot()
            assert copy.lookup_counters == pool.lookup_counters
            assert copy.num_refusals == pool.num_refusals
            self.pool = copy
            self.reloads += 1
        return self.pool


@pytest.mark.parametrize("name", TRACES)
def test_trace_passes_with_pool_reloaded_from_its_state(name: str) -> None:
    target = ReloadingTarget(every=7)
    result = replay(load_trace(DATA / f"{name}.jsonl"), target)
    assert result.mismatch is None, result.mismatch
    assert target.reloads > 0


def test_state_of_another_version_is_refused() -> None:
    target = LocalTarget()
    trace = load_trace(DATA / "unitary_full16_tiny.jsonl")
    target.open(trace.config)
    value = export_state(target._p())
    value["version"] = STATE_VERSION + 1
    with pytest.raises(StateError, match="version"):
        import_state(target._p().config, value)


DATA_033 = Path(__file__).resolve().parents[1] / "conformance" / "data-vllm-0.33"


@pytest.mark.parametrize(
    "name",
    [
        "nocache_full16",
        "unitary_full16_tiny",
        "unitary_full16_sha256_lora_salt",
        "hybrid_full16_swa16_w128_tiny",
        "hybrid_full16_full32_swa16_w64",
        "hybrid_full32_mamba32_align",
    ],
)
def test_033_trace_passes_with_pool_reloaded_from_its_state(name: str) -> None:
    """vllm-0.33 pools too: the blocks freed to the head of the queue, the events'
    extra fields, the requests' cache salts, prompt lengths and shared-prefix
    boundaries survive export and import, and so do a mamba group's retired ranges,
    same-step hashes, untaken boundary states and the untaken new block ids."""
    target = ReloadingTarget(every=7)
    result = replay(load_trace(DATA_033 / f"{name}.jsonl"), target)
    assert result.mismatch is None, result.mismatch
    assert target.reloads > 0
