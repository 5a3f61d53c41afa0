"""The memory estimate of a pool, counted against ``[limits] max_pool_memory_bytes``.

Figures from ``bench/memory.py`` (CPython 3.11): a used block costs about
:data:`ENGINE_BLOCK_BYTES` (its object, free-queue slot, hash-map entry, block-table
slot) and every token a request holds about :data:`ENGINE_TOKEN_BYTES` (its id, block
hashes and their cached keys). A pool's blocks are created on first use, but a full
pool uses every one, and its requests hold up to ``hash_block_size`` tokens per block.

The pool's event buffer (events.py) keeps stored blocks' hashes and token ids after
their requests are gone; it is bounded by :func:`event_buffer_bytes`, as much as two
events per block, one holding the block's hash and tokens (:data:`EVENT_BLOCK_BYTES`,
:data:`EVENT_TOKEN_BYTES`: measured in tests/service/test_streams.py), and dropping
its oldest events past that. So the estimate is the pool at full use with a full
buffer::

    num_blocks x (BLOCK_BYTES + TOKEN_BYTES x hash_block_size)
    BLOCK_BYTES = ENGINE_BLOCK_BYTES + EVENT_BLOCK_BYTES
    TOKEN_BYTES = ENGINE_TOKEN_BYTES + EVENT_TOKEN_BYTES
"""

from __future__ import annotations

import dataclasses

from .errors import ServiceError, Status
from .events import EVENT_BYTES, EVENT_HASH_BYTES, EVENT_TOKEN_BYTES

__all__ = [
    "BLOCK_BYTES",
    "ENGINE_BLOCK_BYTES",
    "ENGINE_TOKEN_BYTES",
    "EVENT_BLOCK_BYTES",
    "TOKEN_BYTES",
    "MemoryBudget",
    "event_buffer_bytes",
    "pool_bytes",
]

ENGINE_BLOCK_BYTES = 160
ENGINE_TOKEN_BYTES = 70
#: the event buffer's share per block: a BlockRemoved and a one-block BlockStored (its
#: hash and parent hash), so a whole pool replaced between two takes fits
EVENT_BLOCK_BYTES = 2 * EVENT_BYTES + 3 * EVENT_HASH_BYTES
BLOCK_BYTES = ENGINE_BLOCK_BYTES + EVENT_BLOCK_BYTES
TOKEN_BYTES = ENGINE_TOKEN_BYTES + EVENT_TOKEN_BYTES


def event_buffer_bytes(num_blocks: int, hash_block_size: int) -> int:
    """The bound of a pool's event buffer (estimated bytes; part of :func:`pool_bytes`)."""
    return num_blocks * (EVENT_BLOCK_BYTES + EVENT_TOKEN_BYTES * max(hash_block_size, 1))


def pool_bytes(num_blocks: int, hash_block_size: int) -> int:
    """The estimated bytes of a pool at full use."""
    return num_blocks * (BLOCK_BYTES + TOKEN_BYTES * max(hash_block_size, 1))


@dataclasses.dataclass(slots=True)
class MemoryBudget:
    """The pools' estimated memory against a budget.

    Args:
        limit: ``max_pool_memory_bytes``.
    """

    limit: int
    used: int = 0

    def check(self, name: str, num_blocks: int, hash_block_size: int, num_pools: int) -> int:
        """The pool's estimate, once it fits.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED with the arithmetic.
        """
        need = pool_bytes(num_blocks, hash_block_size)
        if self.used + need > self.limit:
            per_block = BLOCK_BYTES + TOKEN_BYTES * max(hash_block_size, 1)
            raise ServiceError(
                Status.EXHAUSTED,
                f"pool {name[:128]!r} does not fit the memory budget: it needs an estimated "
                f"{need:,} bytes ({num_blocks:,} blocks x {per_block:,} bytes = {BLOCK_BYTES} per block + "
                f"{TOKEN_BYTES} per token x {hash_block_size} tokens per block, its event buffer included), "
                f"but {self.used:,} of "
                f"max_pool_memory_bytes {self.limit:,} are taken by {num_pools} pool(s), leaving "
                f"{max(self.limit - self.used, 0):,}; use fewer blocks or delete a pool",
            )
        return need
