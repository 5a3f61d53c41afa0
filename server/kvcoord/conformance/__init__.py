"""Conformance: replay traces recorded from vLLM and compare every answer."""

from .replay import Mismatch, ReplayResult, replay
from .target import LocalTarget, ReplayTarget, event_to_json, stats_to_json
from .trace import Trace, TraceFormatError, config_from_trace, load_trace, spec_from_dict

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
    "replay",
    "spec_from_dict",
    "stats_to_json",
]
