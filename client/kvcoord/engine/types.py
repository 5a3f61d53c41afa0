"""Identifier types shared by the engine modules."""

from __future__ import annotations

from typing import NewType

__all__ = ["BlockHash", "BlockHashWithGroupId", "BlockId", "RequestId", "NULL_BLOCK_ID"]

BlockId = NewType("BlockId", int)
"""Index of a physical KV block in the pool, ``0 .. num_blocks - 1``."""

RequestId = NewType("RequestId", str)
"""A request's id, unique within one pool."""

BlockHash = NewType("BlockHash", bytes)
"""An opaque block hash computed by the client (possibly a merged one)."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""``hash ‖ uint32_be(group)``: the key under which a cached block is found."""

NULL_BLOCK_ID = BlockId(0)
"""The placeholder block: never free, never cached, never newly allocated."""
