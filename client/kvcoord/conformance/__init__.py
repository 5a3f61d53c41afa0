"""Conformance: replay traces recorded from vLLM and compare every answer."""

from .replay import Mismatch, ReplayResult, replay
from .target import LocalTarget, ReplayTarget, event_to_json, stats_to_json
from .trace import Trace, TraceFormatError, config_from_trace, load_trace, pool_config_from_trace

__all__ = [
    "LocalTarget",
    "Mismatch",
    "ReplayResult",
    "ReplayTarget",
    "Trace",
    "TraceFormatError",
    "config_from_trace",
    "event_to_json",
    "load_trace",
    "pool_config_from_trace",
    "replay",
    "stats_to_json",
]
