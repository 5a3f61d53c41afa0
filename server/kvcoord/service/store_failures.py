"""The store journal's failures (store_journal.py): which writes the store refused for
good (:func:`refused`), and the records given up, as flushes ask about them.

A flush fails when a record of a pool its task marked (``PoolStreams.answers_on``) was
given up after the mark (not settled then) and no later than the flush's target, unless
it is of a stream the pool's had left already: queued before the mark at another term
than the stream's then. A stream begins with a base of the pool's whole state here, so
what is answered on it (at the mark or after) rests on it alone: an older term's records
given up (deposed: the pool claimed again, rebuilt or adopted here) fail the flushes
that marked the pool at that term, not a rebuild's (they did: its own flush failed,
after the pool was loaded and claimed). A record queued after the mark always counts,
whatever its term (a kept answer's mark is taken before the pool's lock, its answer read
after: at a later term, maybe); so does every record when the pool had no stream here at
the mark. Nothing here assumes terms only grow.

The records are kept in a list pruned once it is longer than :data:`KEEP`: what no
waiting flush needs is dropped. But a flush may need a record dropped so: one woken by
the very batch whose failures made the list long (it reads the list after the prune), or
a task that marked its pool and waits elsewhere first (its local journal's commit, the
pool's lock). So the last record dropped of each pool and term is remembered, and a
flush whose mark of that pool is older cannot tell: it fails as if the record were its
own (UNAVAILABLE: never an answer that may rest on a record the pool's next owner
lacks), unless that record is of a stream left before the mark (as above). Marks made
after a prune are not older: it drops only records settled before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = ["KEEP", "REFUSALS", "GivenUp", "Mark", "refused"]

#: given-up records kept before the list is pruned (and pools' terms remembered one by one)
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


class Mark(NamedTuple):
    """A task's first mark of a pool since its last flush."""

    #: the store journal's records settled then (committed or given up)
    settled: int
    #: its records queued then
    queued: int
    #: the term of the pool's stream then (None: not open here, every record counts)
    term: int | None

    def counts(self, gseq: int, term: int) -> bool:
        """A record given up (``gseq``, of ``term``) may be one the answer rests on."""
        return gseq > self.settled and (gseq > self.queued or self.term is None or term == self.term)


class GivenUp:
    """Records given up (their global sequence, their pool, their term), and what pruning forgot."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._records: list[tuple[int, str, int]] = []
        #: pool -> term -> the last of its records of that term dropped by a prune
        self._forgotten: dict[str, dict[int, int]] = {}
        self._forgotten_count = 0
        #: the last record dropped of a pool no longer remembered one by one (too many)
        self._forgotten_any = 0

    def add(self, pool: str, records: Iterable[tuple[int, int]]) -> None:
        """Given up: ``pool``'s records (global sequence, term)."""
        self._records.extend((g, pool, term) for g, term in records)

    def prune(self, oldest: int) -> None:
        """Once the list is long, drop the records up to ``oldest`` (the oldest mark a
        waiting flush holds), remembering the last one dropped of each pool and term."""
        if len(self._records) <= self.keep:
            return
        kept = []
        for g, pool, term in self._records:
            if g > oldest:
                kept.append((g, pool, term))
                continue
            terms = self._forgotten.setdefault(pool, {})
            self._forgotten_count += term not in terms
            terms[term] = max(terms.get(term, 0), g)
        self._records = kept
        if self._forgotten_count > self.keep:
            self._forgotten_any = max(
                self._forgotten_any, *(max(t.values()) for t in self._forgotten.values())
            )
            self._forgotten.clear()
            self._forgotten_count = 0

    def lost(self, marks: Mapping[str, Mark], target: int) -> list[str]:
        """The marked pools a flush up to ``target`` must fail for: a record given up that
        its mark counts (:meth:`Mark.counts`), or one it cannot tell."""
        lost = {
            pool
            for g, pool, term in self._records
            if (mark := marks.get(pool)) is not None and g <= target and mark.counts(g, term)
        }
        for pool, mark in marks.items():
            forgotten = self._forgotten.get(pool, {})  # (the last one of a term counts if any did)
            if self._forgotten_any > mark.settled or any(mark.counts(g, t) for t, g in forgotten.items()):
                lost.add(pool)
        return sorted(lost)
