"""What block ids are meaningful within (kept apart from pool_service.py, which
positions.py's checks serve, so neither imports the other)."""

from __future__ import annotations

import dataclasses

__all__ = ["Fence"]


@dataclasses.dataclass(frozen=True, slots=True)
class Fence:
    """What block ids are meaningful within: a server instance and a pool incarnation."""

    instance_id: str
    incarnation: int
    #: the journal position the holder was told (positions.py); 0: none
    position: int = 0
    #: the pool's ownership term in a cluster (ownership.py); 0: a single node
    term: int = 0
    #: what proves the server issued ``position`` (positions.py); b"": none
    position_tag: bytes = b""
