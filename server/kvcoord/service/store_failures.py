"""The store journal's failures (store_journal.py): which writes the store refused for
good (:func:`refused`), and the records given up, as flushes ask about them.

A flush fails when a record of a pool its task marked (``PoolStreams.answers_on``) was
given up after the mark and no later than the flush's target. The records are kept in a
list pruned once it is longer than :data:`KEEP`: what no waiting flush needs is dropped.
But a flush may need a record dropped so: one woken by the very batch whose failures made
the list long (it reads the list after the prune), or a task that marked its pool and
waits elsewhere first (its local journal's commit, the pool's lock). So the last record
dropped of each pool is remembered, and a flush whose mark of that pool is older cannot
tell: it fails as if the record were its own (UNAVAILABLE: never an answer that may rest
on a record the pool's next owner lacks). Marks made after a prune are not older: it drops
only records settled before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["KEEP", "REFUSALS", "GivenUp", "refused"]

#: given-up records kept before the list is pruned (and pools remembered one by one)
KEEP = 4096
#: gRPC statuses of a write the store refused for good (NOSPACE, too large, access; not
#: "too many requests"): not retried. Any other failure's write may have been made.
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "PERMISSION_DENIED"})


def refused(exc: BaseException) -> bool:
    """The store refused the write (:data:`REFUSALS`; aetcd's error or its cause)."""
    for error in (exc, exc.__cause__):
        code, details = getattr(error, "code", None), getattr(error, "details", None)
        if callable(code) and getattr(code(), "name", None) in REFUSALS:
            return "too many requests" not in str(details() if callable(details) else "")
    return False


class GivenUp:
    """Records given up (their global sequence, their pool), and what pruning forgot."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._records: list[tuple[int, str]] = []
        #: pool -> the last of its records dropped by a prune
        self._forgotten: dict[str, int] = {}
        #: the last record dropped of a pool no longer remembered one by one (too many)
        self._forgotten_any = 0

    def add(self, pool: str, gseqs: Iterable[int]) -> None:
        self._records.extend((g, pool) for g in gseqs)

    def prune(self, oldest: int) -> None:
        """Once the list is long, drop the records up to ``oldest`` (the oldest mark a
        waiting flush holds), remembering the last one dropped of each pool."""
        if len(self._records) <= self.keep:
            return
        kept = []
        for g, pool in self._records:
            if g > oldest:
                kept.append((g, pool))
            elif g > self._forgotten.get(pool, 0):
                self._forgotten[pool] = g
        self._records = kept
        if len(self._forgotten) > self.keep:
            self._forgotten_any = max(self._forgotten_any, *self._forgotten.values())
            self._forgotten.clear()

    def lost(self, marks: Mapping[str, int], target: int) -> list[str]:
        """The marked pools (pool -> the records settled at its mark) a flush up to
        ``target`` must fail for: a record given up since the mark, or one it cannot tell."""
        lost = {pool for g, pool in self._records if pool in marks and marks[pool] < g <= target}
        lost.update(
            pool
            for pool, mark in marks.items()
            if max(self._forgotten.get(pool, 0), self._forgotten_any) > mark
        )
        return sorted(lost)
