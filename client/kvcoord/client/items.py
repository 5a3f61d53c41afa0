"""What a Step carries and what callers hold until it is answered: :class:`Item` (one
queued operation and how its answer reads), :class:`Pending` (a call's result once its
Step is answered) and :class:`KVCacheBlockIds` (block ids per group)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from kvcoord.v1 import allocator_pb2 as pb

from .errors import KVCoordError

__all__ = ["Item", "KVCacheBlockIds", "Pending", "ids"]

T = TypeVar("T")


class Pending(Generic[T]):
    """The result of a batched call, available once its Step was answered.

    Args:
        resolve: called by :meth:`result` while the value is not there yet (the
            manager flushes its queue); ``None``: result() before the flush raises.
    """

    __slots__ = ("_done", "_error", "_value", "resolver")

    def __init__(self, resolve: Callable[[], None] | None = None) -> None:
        self._value: T | None = None
        self._error: KVCoordError | None = None
        self._done = False
        #: called by :meth:`result` while the value is not there (the sender's flush)
        self.resolver = resolve

    def set_result(self, value: T) -> None:
        """The call's answer (its Step was answered)."""
        self._value, self._done = value, True

    def set_error(self, error: KVCoordError) -> None:
        """The call failed (or was aborted): :meth:`result` raises ``error``."""
        self._error, self._done = error, True

    @property
    def done(self) -> bool:
        return self._done

    def result(self) -> T:
        """The value; raises the call's error, or RuntimeError before the flush."""
        if not self._done and self.resolver is not None:
            self.resolver()
        if not self._done:
            raise RuntimeError("the batch has not been flushed yet")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class KVCacheBlockIds:
    """Block ids per KV cache group (0 = null block), like vLLM's ``KVCacheBlocks``.

    ``table`` is the request's whole block table after the allocation, when asked for
    (``allocate_slots(..., return_table=True)``).
    """

    __slots__ = ("_ids", "_table")

    def __init__(self, block_ids: tuple[list[int], ...], table: tuple[list[int], ...] | None = None) -> None:
        self._ids = block_ids
        self._table = table

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        return self._ids

    @property
    def table(self) -> tuple[list[int], ...] | None:
        return self._table

    @property
    def resolved(self) -> bool:
        """Always True: every answer holds its ids (no manager answers ahead any more)."""
        return True

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self._ids

    def is_empty(self) -> bool:
        return not any(self._ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlockIds) and self._ids == other.block_ids

    def __hash__(self) -> int:
        return hash(tuple(tuple(g) for g in self._ids))

    def __repr__(self) -> str:
        return f"KVCacheBlockIds({self._ids!r})"


def ids(groups: Iterable[pb.BlockIds]) -> KVCacheBlockIds:
    return KVCacheBlockIds(tuple(list(g.block_ids) for g in groups))


@dataclasses.dataclass(slots=True)
class Item:
    """One queued operation: the op, how to read its result, the requests whose
    positions it moves, and who waits for it."""

    op: pb.Operation
    #: reads the answer (an OperationResult)
    decode: Callable[[Any], Any]
    touched: Sequence[str]
    pending: Pending[Any]
    #: True when nobody waits for the answer (frees, cache_blocks, ...): its error, if
    #: any, is raised by whichever call sends it
    deferred: bool = False
    #: True when ``decode`` commits positions itself (an Admit commits only the
    #: requests the server processed)
    commits_itself: bool = False
    #: per touched request, its position right after this call's sync (what the
    #: server holds once this call is applied)
    marks: dict[str, tuple[int, int, int, bool] | None] | None = None
