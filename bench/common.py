"""Helpers the step benchmarks share (imported from the scripts' own directory)."""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """What vLLM's engine core does once built (freeze_gc_heap): the objects alive now
    (vLLM, torch, the scheduler or pool) leave the collector's view, so a full
    collection does not walk them every few hundred steps (with vLLM imported, one
    stalls 100-300 ms)."""
    gc.collect()
    gc.freeze()


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (seconds), in milliseconds."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3
