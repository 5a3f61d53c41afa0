"""Attention specs: what kind of attention a KV cache group runs.

Specs are frozen values. Two groups whose specs are equal (type included, page-size
fields included) form one *attention group* in the hybrid coordinator; the page-size
fields (heads, head size, dtype, state shapes) never change allocation otherwise.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "MambaCacheMode",
    "MambaSpec",
    "SlidingWindowSpec",
]


@dataclasses.dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Full (causal) attention; also MLA (``use_mla``) and sink attention (``sink_len``).

    ``sliding_window`` and ``attention_chunk_size`` are informational only: vLLM
    keeps them on a full spec when the hybrid manager is disabled.
    """

    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "auto"
    use_mla: bool = False
    sink_len: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Sliding-window attention over the last ``sliding_window`` tokens."""

    block_size: int
    sliding_window: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "auto"


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec:
    """Attention restricted to the current chunk of ``attention_chunk_size`` tokens."""

    block_size: int
    attention_chunk_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "auto"


class MambaCacheMode(enum.StrEnum):
    """How mamba states are kept for prefix caching."""

    NONE = "none"
    ALL = "all"
    ALIGN = "align"


@dataclasses.dataclass(frozen=True, slots=True)
class MambaSpec:
    """A mamba (state space) layer group: only the last state matters."""

    block_size: int
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.NONE
    num_speculative_blocks: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    #: vLLM 0.33, align mode: blocks reserved so a prompt's final chunk can export the
    #: state at its last reusable boundary (0: none; vLLM's models set 1)
    num_prefill_checkpoint_blocks: int = 0
    #: vLLM 0.33: the grid (tokens from the chunk's start) the backend can export that
    #: state on; ``None``: it cannot, so no checkpoint is taken
    prefill_checkpoint_alignment: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class CrossAttentionSpec:
    """Encoder-decoder cross-attention: blocks sized from the encoder input length."""

    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "auto"


AttentionSpec = (
    FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MambaSpec | CrossAttentionSpec
)


def event_spec_fields(spec: AttentionSpec) -> tuple[str, int | None]:
    """vLLM 0.33's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` of a
    group's spec, as its BlockStored events carry them."""
    if isinstance(spec, FullAttentionSpec):
        if spec.use_mla:
            return "mla_attention", None
        return ("sink_full_attention" if spec.sink_len else "full_attention"), None
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window", spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked_local_attention", None
    if isinstance(spec, MambaSpec):
        return "mamba", None
    return "cross_attention", None
