"""Reading conformance traces (JSON Lines recorded from vLLM)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvcoord.client.hashing import HASH_LENGTHS
from kvcoord.engine import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = ["Trace", "TraceFormatError", "config_from_trace", "load_trace", "spec_from_dict"]


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


def spec_from_dict(group: dict[str, Any]) -> AttentionSpec:
    """One group object of a trace (or config file) as an engine spec.

    Raises:
        TraceFormatError: unknown type or missing field.
    """
    kind = group.get("type")
    try:
        bs = int(group["block_size"])
        if kind == "full":
            return FullAttentionSpec(bs)
        if kind == "sliding_window":
            return SlidingWindowSpec(bs, int(group["sliding_window"]))
        if kind == "chunked_local":
            return ChunkedLocalAttentionSpec(bs, int(group["attention_chunk_size"]))
        if kind == "mamba":
            return MambaSpec(
                bs,
                MambaCacheMode(group.get("mamba_cache_mode", "none")),
                int(group.get("num_speculative_blocks", 0)),
            )
        if kind == "cross_attention":
            return CrossAttentionSpec(bs)
    except (KeyError, ValueError) as exc:
        raise TraceFormatError(f"group {group!r}: {exc}") from None
    raise TraceFormatError(f"unknown group type {kind!r}")


def config_from_trace(cfg: dict[str, Any]) -> KVCacheConfig:
    """The engine configuration a trace's config line describes."""
    algo = cfg.get("hash_algo")
    return KVCacheConfig(
        num_blocks=cfg["num_blocks"],
        groups=tuple(spec_from_dict(g) for g in cfg["groups"]),
        hash_block_size=cfg["hash_block_size"],
        enable_caching=cfg["enable_caching"],
        use_eagle=cfg["use_eagle"],
        enable_kv_cache_events=cfg["enable_kv_cache_events"],
        log_stats=cfg.get("log_stats", True),
        max_model_len=cfg["max_model_len"],
        hash_length=HASH_LENGTHS.get(algo) if algo else None,
        dcp_world_size=cfg.get("dcp_world_size", 1),
        pcp_world_size=cfg.get("pcp_world_size", 1),
    )
