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
    """The file is not a format-1 conformance trace."""


@dataclasses.dataclass(frozen=True, slots=True)
class Trace:
    """A parsed trace: its configuration line and its operations (line 2 onwards)."""

    path: Path
    config: dict[str, Any]
    ops: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.stem)


def load_trace(path: str | Path) -> Trace:
    """Parse a trace file.

    Raises:
        TraceFormatError: not JSON Lines, no config line, or an unknown format version.
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
    if records[0].get("format_version") != 1:
        raise TraceFormatError(
            f"{p}: format_version {records[0].get('format_version')!r} is not supported (want 1)"
        )
    return Trace(p, records[0], records[1:])


# The config line's fields that describe the pool; the rest (name, seed, workload, ...)
# are informational. Same names as a [[pools]] table of the server's config file.
_POOL_FIELDS = (
    "num_blocks", "groups", "hash_block_size", "enable_caching", "use_eagle", "enable_kv_cache_events",
    "log_stats", "max_model_len", "hash_algo", "hash_seed",
)  # fmt: skip


def pool_config_from_trace(cfg: dict[str, Any]) -> pb.PoolConfig:
    """The wire PoolConfig a trace's config line describes.

    Raises:
        TraceFormatError: context parallelism other than 1, or a malformed group.
    """
    for key in ("dcp_world_size", "pcp_world_size"):
        if cfg.get(key, 1) != 1:
            raise TraceFormatError(f"{key} = {cfg[key]} is not supported (kvcoord fixes it to 1)")
    table = {k: cfg[k] for k in _POOL_FIELDS if cfg.get(k) is not None}
    try:
        return pool_config_from_table(table, "trace config")
    except ConfigFileError as exc:
        raise TraceFormatError(str(exc)) from None


def config_from_trace(cfg: dict[str, Any]) -> KVCacheConfig:
    """The engine configuration a trace's config line describes."""
    return config_from_pb(pool_config_from_trace(cfg))
