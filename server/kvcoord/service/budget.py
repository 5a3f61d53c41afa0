"""The memory estimate of a pool, counted against ``[limits] max_pool_memory_bytes``.

Figures from ``bench/memory.py`` (CPython 3.11): a used block costs about
:data:`BLOCK_BYTES` (its object, free-queue slot, hash-map entry, block-table slot)
and every token a request holds about :data:`TOKEN_BYTES` (its id, block hashes and
their cached keys). A pool's blocks are created on first use, but a full pool uses
every one, and its requests hold up to ``hash_block_size`` tokens per block, so the
estimate is the pool at full use::

    num_blocks x (BLOCK_BYTES + TOKEN_BYTES x hash_block_size)
"""

from __future__ import annotations

import dataclasses

import grpc

from .errors import ServiceError

__all__ = ["BLOCK_BYTES", "TOKEN_BYTES", "MemoryBudget", "pool_bytes"]

BLOCK_BYTES = 120
TOKEN_BYTES = 70


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
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"pool {name[:128]!r} does not fit the memory budget: it needs an estimated "
                f"{need:,} bytes ({num_blocks:,} blocks x {per_block:,} bytes = {BLOCK_BYTES} per block + "
                f"{TOKEN_BYTES} per token x {hash_block_size} tokens per block), but {self.used:,} of "
                f"max_pool_memory_bytes {self.limit:,} are taken by {num_pools} pool(s), leaving "
                f"{max(self.limit - self.used, 0):,}; use fewer blocks or delete a pool",
            )
        return need
