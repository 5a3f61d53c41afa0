"""The columns of a decode step's allocations, which :func:`~kvcoord.engine.decode_run.decode_run`
reads. A module of its own, left interpreted in the compiled build (see client/setup.py):
the service's AllocateRun and Decode subclass this dataclass, which they could not do
to a class mypyc compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["DecodeColumns"]


@dataclasses.dataclass(slots=True)
class DecodeColumns:
    """A decode step's allocations in columns (the service's AllocateRun and Decode
    operations are these): per entry a request, where it stands (tokens and hashes
    held), its computed count, its counts, and how many tokens and hashes it appends
    from the flattened columns."""

    request_ids: Sequence[str]
    base_num_tokens: Sequence[int]
    base_num_hashes: Sequence[int]
    num_computed_tokens: Sequence[int]
    num_new_tokens: Sequence[int]
    num_lookahead_tokens: Sequence[int]
    num_append_tokens: Sequence[int]
    append_token_ids: Sequence[int]
    num_append_hashes: Sequence[int]
    append_block_hashes: Sequence[bytes]
