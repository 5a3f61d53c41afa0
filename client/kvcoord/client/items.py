"""What a Step carries and what callers hold until it is answered: in the waiting
mode, :class:`Item` (one queued operation and how its answer reads) and
:class:`Pending` (a call's result once its Step is answered); in the predicted mode,
:class:`Gathered` (the Step being gathered, with the mirror's answers) and
:class:`ColumnRun` (its allocations as the columns of one AllocateRunOp); and
:class:`KVCacheBlockIds` (block ids per group), which both modes answer with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any, Generic, TypeVar

from kvcoord.engine import KVCacheEvent, PrefixCacheStats
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import uncomputed_from_pb

from .errors import KVCoordError

__all__ = [
    "NO_ADMISSION",
    "Admission",
    "ColumnRun",
    "Gathered",
    "Item",
    "KVCacheBlockIds",
    "Pending",
    "add_stats",
    "ids",
    "no_answer",
    "put_admission",
    "to_send_again",
    "touched",
]

T = TypeVar("T")

#: vLLM 0.33's admission inputs of an allocation: full_sequence_must_fit, reserved_blocks,
#: num_in_flight_tokens, watermark_blocks, skip_zeroing_group_ids
Admission = tuple[bool, int, int, int, tuple[int, ...]]
#: a manager's ``admission`` outside vLLM 0.33's allocate_slots (and under 0.16 always)
NO_ADMISSION: Admission = (False, 0, 0, 0, ())


def put_admission(a: pb.AllocateOp, admission: Admission) -> None:
    """Write vLLM 0.33's admission inputs into an allocation's operation (the defaults,
    :data:`NO_ADMISSION`, are what an unset field means)."""
    full, a.reserved_blocks, a.num_in_flight_tokens, a.watermark_blocks, skip_zeroing = admission
    a.full_sequence_must_fit = full
    a.skip_zeroing_group_ids.extend(skip_zeroing)


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


def add_stats(into: Any, more: Any) -> None:
    """Add ``more``'s prefix-cache statistics to ``into`` (engine values or messages;
    written out: a predicted session adds them every scheduler step)."""
    into.reset = into.reset or more.reset
    into.requests += more.requests
    into.queries += more.queries
    into.hits += more.hits
    into.preempted_requests += more.preempted_requests
    into.preempted_queries += more.preempted_queries
    into.preempted_hits += more.preempted_hits


def no_answer(result: Any) -> None:
    """How an operation whose answer says nothing (a free, cache_blocks, ...) reads it."""


@dataclasses.dataclass(slots=True)
class Item(Generic[T]):
    """One queued operation: the op, how to read its result (an OperationResult), the
    requests whose positions it moves, and who waits for it."""

    op: pb.Operation
    decode: Callable[[Any], T]
    touched: Sequence[str] = ()
    #: True when nobody waits for the answer (frees, cache_blocks, ...): its error, if
    #: any, is raised by whichever call sends it
    deferred: bool = False
    #: True when ``decode`` commits positions itself (an Admit commits only the
    #: requests the server processed)
    commits_itself: bool = False
    #: per touched request, its position right after this call's sync (what the
    #: server holds once this call is applied)
    marks: dict[str, tuple[int, int, int, bool] | None] | None = None
    pending: Pending[T] = dataclasses.field(default_factory=Pending)


def touched(items: Iterable[Item[Any]]) -> list[str]:
    """The requests a Step's items sync (only theirs roll back when it fails: calls
    collected in an open batch keep theirs)."""
    return [rid for i in items for rid in i.touched]


def to_send_again(items: Iterable[Item[Any]]) -> tuple[list[pb.FreeOp], list[Item[None]]]:
    """Of queued calls that were not applied, or may not have been, what must be sent
    again: each free, a copy of its FreeOp (its order and ``uncomputed_from`` kept), and
    each undone step's drop (``drop_uncomputed``) whose request's free is not among
    them, queued anew; a drop whose request's free is goes with that free (the lower
    token)."""
    drops = {
        i.op.drop_uncomputed.request_id: i.op for i in items if i.op.WhichOneof("op") == "drop_uncomputed"
    }
    frees: list[pb.FreeOp] = []
    for i in items:
        if i.op.WhichOneof("op") == "free":
            free = pb.FreeOp()
            free.CopyFrom(i.op.free)
            drop = drops.pop(free.request_id, None)
            if drop is not None:
                froms = (uncomputed_from_pb(free), drop.drop_uncomputed.uncomputed_from)
                free.uncomputed_from = min(n for n in froms if n is not None)
            frees.append(free)
    return frees, [Item(op, no_answer, deferred=True) for op in drops.values()]


#: all-zero statistics, shared: a Step's statistics when it recorded none (read, never changed)
NO_STATS = PrefixCacheStats()


class Gathered:
    """A predicted session's Step being gathered: its operations (written in place into its request) and what the mirror
    says their answers are."""

    __slots__ = (
        "dropped",
        "events",
        "expected",
        "num_free_blocks",
        "request",
        "runs",
        "size",
        "stats",
        "writes",
    )

    def __init__(self) -> None:
        self.request = pb.StepRequest(include_state=True, events_digest=True)
        #: about how many bytes the request holds (an upper bound for its tokens and hashes)
        self.size = 0
        #: each run of allocations and its operation, whose columns are written on the
        #: sender thread (just before the Step is sent), not on the scheduler's
        self.runs: list[tuple[pb.Operation, ColumnRun]] = []
        #: (operation index, what writes the rest of its fields), also on the sender thread
        self.writes: list[tuple[int, Callable[[], object]]] = []
        #: per op: its ColumnRun, None, or (kind, the mirror's answer): "new" (an allocation's
        #: new block ids per group), "reset" or "common_prefix"
        self.expected: list[Any] = []
        self.num_free_blocks = 0
        #: the mirror's events (the engine's values), digested on the sender thread
        self.events: list[KVCacheEvent] = []
        #: the mirror's statistics (the engine's value; set when the Step is cut)
        self.stats = NO_STATS
        #: what the step's frees let go of (the tracker's and the engine's records of
        #: each freed request: its token list, hashes, noted positions), deallocated on
        #: the sender thread with the Step once it is sent, while the model runs, not in
        #: the scheduler's free (nothing reads them)
        self.dropped: list[object] = []


class ColumnRun:
    """A Step's allocations of registered requests without a hit, gathered as the
    columns of one AllocateRunOp, with the block ids the mirror gave them (the
    columns of its answer). The scheduler's thread only appends each entry's values
    (``StepGathering.add_to_run``); the columns are written on the sender thread
    (:meth:`write`, :meth:`matches`).

    The entries are kept as plain values in flat lists, not as a tuple each: a
    running request's step then leaves no new container behind until the Step is
    sent (each would count towards, and be walked by, the garbage collector's young
    collections on the scheduler's thread)."""

    __slots__ = ("fixed", "hashes", "news", "size", "tokens")

    def __init__(self) -> None:
        #: per entry, 8 values: request id, base tokens, base hashes,
        #: computed tokens, new tokens, look-ahead tokens, appended tokens, appended hashes
        self.fixed: list[Any] = []
        #: every entry's appended tokens and hashes, in entry order
        self.tokens: list[int] = []
        self.hashes: list[bytes] = []
        #: per entry, the new block ids per group the mirror gave it
        self.news: list[Sequence[Sequence[int]]] = []
        #: about how many bytes the entries take on the wire
        self.size = 0

    def __len__(self) -> int:
        return len(self.news)

    def write(self, op: pb.AllocateRunOp | pb.DecodeOp) -> None:
        """The entries as ``op``'s columns (an AllocateRunOp, or a DecodeOp with
        must_succeed where the server applies one: the same columns)."""
        fixed = self.fixed
        op.request_ids.extend(fixed[0::8])
        op.base_num_tokens.extend(fixed[1::8])
        op.base_num_hashes.extend(fixed[2::8])
        op.num_computed_tokens.extend(fixed[3::8])
        op.num_new_tokens.extend(fixed[4::8])
        op.num_lookahead_tokens.extend(fixed[5::8])
        op.num_append_tokens.extend(fixed[6::8])
        op.append_token_ids.extend(self.tokens)
        op.num_append_hashes.extend(fixed[7::8])
        op.append_block_hashes.extend(self.hashes)

    def matches(self, answer: pb.AllocateRunResult | pb.DecodeResult) -> bool:
        """Whether the server's answer gives each entry the mirror's blocks (a
        DecodeResult: and applies every entry, none refused)."""
        if isinstance(answer, pb.DecodeResult) and (answer.num_applied != len(self.news) or answer.refused):
            return False
        groups = list(chain.from_iterable(self.news))  # every entry's, in order
        return list(answer.num_new_blocks) == list(map(len, groups)) and list(answer.new_block_ids) == list(
            chain.from_iterable(groups)
        )
