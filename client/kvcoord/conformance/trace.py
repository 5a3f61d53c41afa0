"""Reading conformance traces (JSON Lines recorded from vLLM)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvcoord.engine import KVCacheConfig
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import ConfigFileError, config_from_pb, pool_config_from_table

__all__ = ["Trace", "TraceFormatError", "config_from_trace", "load_trace", "pool_config_from_trace"]


class TraceFormatError(ValueError):
    """The file is not a conformance trace this replayer reads (format 1 or 2)."""


#: the trace formats read, and the semantics profile each one's recordings follow:
#: format 1 was recorded from vLLM 0.16.0, format 2 from vLLM 0.33.0
FORMAT_PROFILES = {1: "vllm-0.16", 2: "vllm-0.33"}


@dataclasses.dataclass(frozen=True, slots=True)
class Trace:
    """A parsed trace: its configuration line and its operations (line 2 onwards)."""

    path: Path
    config: dict[str, Any]
    ops: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.stem)

    @property
    def format_version(self) -> int:
        return int(self.config["format_version"])


def load_trace(path: str | Path) -> Trace:
    """Parse a trace file.

    Raises:
        TraceFormatError: not JSON Lines, no config line, or a format version other than
            1 (vLLM 0.16.0 recordings) and 2 (vLLM 0.33.0).
        OSError: the file cannot be read.
    """
    p = Path(path)
    lines = p.read_text(encoding="utf-8").splitlines()
    records = []
    for no, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{p}:{no}: not JSON: {exc}") from None
    if not records or records[0].get("kind") != "config":
        raise TraceFormatError(f"{p}: the first line must be the config record")
    version = records[0].get("format_version")
    if isinstance(version, bool) or version not in FORMAT_PROFILES:
        raise TraceFormatError(f"{p}: format_version {version!r} is not supported (want 1 or 2)")
    return Trace(p, records[0], records[1:])


# The config line's fields that describe the pool; the rest (name, seed, workload, ...)
# are informational. Same names as a [[pools]] table of the server's config file.
_POOL_FIELDS = (
    "num_blocks", "groups", "hash_block_size", "enable_caching", "use_eagle", "enable_kv_cache_events",
    "log_stats", "max_model_len", "hash_algo", "hash_seed", "num_hash_lookahead_tokens",
    "max_in_flight_tokens", "scheduler_block_size",
)  # fmt: skip


# Format-2 manager inputs and the only values kvcoord's vllm-0.33 profile takes so far;
# a trace recorded with another value is refused rather than replayed wrongly.
_FIXED_033 = {
    "num_prefill_lookahead": (0, 1),  # vLLM re-prefills num_prefill_lookahead - 1 tokens
    "watermark": (0, 0.0),
    "enable_mamba_shared_prefix_checkpoint": (False,),
    "prefix_cache_retention_interval": (0, None),
}


def pool_config_from_trace(cfg: dict[str, Any]) -> pb.PoolConfig:
    """The wire PoolConfig a trace's config line describes (a format-2 trace's pool
    follows the vllm-0.33 profile).

    Raises:
        TraceFormatError: context parallelism other than 1, a malformed group, or a
            format-2 setting the vllm-0.33 profile does not take.
    """
    for key in ("dcp_world_size", "pcp_world_size"):
        if cfg.get(key, 1) != 1:
            raise TraceFormatError(f"{key} = {cfg[key]} is not supported (kvcoord fixes it to 1)")
    profile = FORMAT_PROFILES.get(cfg.get("format_version", 1))
    if profile is None:
        raise TraceFormatError(f"format_version {cfg.get('format_version')!r} is not supported")
    if profile != "vllm-0.16":
        for key, allowed in _FIXED_033.items():
            if key in cfg and cfg[key] not in allowed:
                raise TraceFormatError(
                    f"{key} = {cfg[key]!r} is not supported by kvcoord's {profile} profile yet"
                )
    table = {k: cfg[k] for k in _POOL_FIELDS if cfg.get(k) is not None}
    if profile != "vllm-0.16":
        table["profile"] = profile
        if "prefix_cache_retention_interval" in cfg:  # vLLM's None (dense) is -1 on the wire
            interval = cfg["prefix_cache_retention_interval"]
            table["prefix_cache_retention_interval"] = -1 if interval is None else interval
        # is_eagle_group picks the groups of 0.33's EAGLE drop, which only use_eagle turns
        # on (and the vllm-0.33 profile refuses use_eagle); without it the flag changes nothing
        if not cfg.get("use_eagle"):
            table["groups"] = [{k: v for k, v in g.items() if k != "is_eagle_group"} for g in table["groups"]]
    try:
        return pool_config_from_table(table, "trace config")
    except ConfigFileError as exc:
        raise TraceFormatError(str(exc)) from None


def config_from_trace(cfg: dict[str, Any]) -> KVCacheConfig:
    """The engine configuration a trace's config line describes."""
    return config_from_pb(pool_config_from_trace(cfg))
