"""What a Step carries and what callers hold until it is answered: :class:`Item` (one
queued operation and how its answer reads), :class:`Run` (promised plain allocations
in columns, one AllocateRunOp), :class:`Pending` (a call's result once its Step is
answered) and :class:`KVCacheBlockIds` (block ids per group, possibly lazy)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from kvcoord.v1 import allocator_pb2 as pb

from .errors import KVCoordError

__all__ = ["Item", "KVCacheBlockIds", "Pending", "Run", "ids"]

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

    May be lazy: an allocation the manager proved will succeed is answered at once,
    and its ids arrive with the next Step; reading them sends that Step if needed.
    ``table`` is the request's whole block table after the allocation, when asked for
    (``allocate_slots(..., return_table=True)``).
    """

    __slots__ = ("_ids", "_index", "_pending", "_run", "_table")

    def __init__(
        self,
        block_ids: tuple[list[int], ...] | None = None,
        pending: Pending[KVCacheBlockIds | None] | None = None,
        table: tuple[list[int], ...] | None = None,
        run: Run | None = None,
        index: int = 0,
    ) -> None:
        self._ids = block_ids
        self._pending = pending
        self._table = table
        self._run = run  # an entry of a run of promised allocations: its slice of the answer
        self._index = index

    def _resolve(self) -> None:
        if self._ids is None:
            run = self._run
            if run is not None:
                run.item.pending.result()  # sends the Step if needed; raises the run's error
                self._ids = run.ids_of(self._index)
                self._run = None
                return
            assert self._pending is not None
            resolved = self._pending.result()
            assert resolved is not None
            self._ids, self._table = resolved.block_ids, resolved.table
            self._pending = None

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        self._resolve()
        assert self._ids is not None
        return self._ids

    @property
    def table(self) -> tuple[list[int], ...] | None:
        self._resolve()
        return self._table

    @property
    def resolved(self) -> bool:
        """True when the ids are here (reading them sends nothing)."""
        if self._run is not None:
            return self._run.item.pending.done
        return self._ids is not None or (self._pending is not None and self._pending.done)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.block_ids

    def is_empty(self) -> bool:
        return not any(self.block_ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlockIds) and self.block_ids == other.block_ids

    def __hash__(self) -> int:
        return hash(tuple(tuple(g) for g in self.block_ids))

    def __repr__(self) -> str:
        return (
            f"KVCacheBlockIds({self.block_ids!r})" if self._ids is not None else "KVCacheBlockIds(<pending>)"
        )


#: the ``op`` of a run's item (its AllocateRunOp is built when the Step is sent)
_NO_OP = pb.Operation()


class Run:
    """A Step's promised plain allocations, in columns: one AllocateRunOp, answered
    as a whole. Each entry's :class:`KVCacheBlockIds` reads its slice of the answer
    when asked (nothing is built per entry when the answer comes).

    Args:
        num_groups: the pool's KV cache groups.
        resolve: sends the Step, when an entry's ids are read before it was sent.
    """

    __slots__ = ("base_h", "base_t", "check_at", "check_computed", "check_look", "check_new", "check_rids",
                 "check_tokens", "computed", "counts", "expected", "hashes", "item", "look", "marks", "n_hash",
                 "n_tok", "new", "new_ids", "num_groups", "promises", "rids", "starts", "tokens", "touched")  # fmt: skip

    def __init__(self, num_groups: int, resolve: Callable[[], None]) -> None:
        self.num_groups = num_groups
        #: every request of the run, entries and checks (lost together if it fails)
        self.touched: list[str] = []
        self.rids: list[str] = []
        self.base_t: list[int] = []
        self.base_h: list[int] = []
        self.computed: list[int] = []
        self.new: list[int] = []
        self.look: list[int] = []
        self.n_tok: list[int] = []
        self.tokens: list[int] = []
        self.n_hash: list[int] = []
        self.hashes: list[bytes] = []
        #: per entry, the request's position once the entry's sync is applied
        self.marks: list[tuple[int, int, int, bool] | None] = []
        #: per entry and group (entry-major), the new blocks its bound expects (-1: unknown)
        self.expected: list[int] = []
        #: (entry, ledger, promise) of the entries whose new blocks the ledger waits for
        self.promises: list[tuple[int, Any, Any]] = []
        self.counts: list[int] = []
        self.new_ids: list[int] = []
        self.starts: list[int] = []
        # checks: allocations answered as changing nothing, each before entry check_at[j]
        self.check_rids: list[str] = []
        self.check_at: list[int] = []
        self.check_computed: list[int] = []
        self.check_new: list[int] = []
        self.check_look: list[int] = []
        self.check_tokens: list[int] = []
        self.item = Item(
            _NO_OP, _no_decode, self.touched, Pending(resolve), deferred=True, commits_itself=True
        )
        self.item.run = self

    def add(
        self,
        request_id: str,
        fields: tuple[int, int, Sequence[int], Sequence[bytes], int],
        num_new_tokens: int,
        num_lookahead_tokens: int,
        mark: tuple[int, int, int, bool] | None,
        expected: Sequence[int] | None,
    ) -> int:
        """Append an entry (``fields`` from :meth:`RequestTracker.sync_run`); its index."""
        bt, bh, toks, hs, comp = fields
        self.touched.append(request_id)
        self.rids.append(request_id)
        self.base_t.append(bt)
        self.base_h.append(bh)
        self.computed.append(comp)
        self.new.append(num_new_tokens)
        self.look.append(num_lookahead_tokens)
        self.n_tok.append(len(toks))
        self.tokens.extend(toks)
        self.n_hash.append(len(hs))
        self.hashes.extend(hs)
        self.marks.append(mark)
        if expected is None:
            self.expected.extend([-1] * self.num_groups)
        else:
            self.expected.extend(expected)
        return len(self.rids) - 1

    def check(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int, num_lookahead_tokens: int,
        num_tokens: int,
    ) -> None:  # fmt: skip
        """Append a check: an allocation answered as changing nothing, for the server to
        confirm (it comes before the next entry added)."""
        self.touched.append(request_id)
        self.check_rids.append(request_id)
        self.check_at.append(len(self.rids))
        self.check_computed.append(num_computed_tokens)
        self.check_new.append(num_new_tokens)
        self.check_look.append(num_lookahead_tokens)
        self.check_tokens.append(num_tokens)

    def op(self) -> pb.Operation:
        return pb.Operation(
            allocate_run=pb.AllocateRunOp(
                request_ids=self.rids, base_num_tokens=self.base_t, base_num_hashes=self.base_h,
                num_computed_tokens=self.computed, num_new_tokens=self.new, num_lookahead_tokens=self.look,
                num_append_tokens=self.n_tok, append_token_ids=self.tokens, num_append_hashes=self.n_hash,
                append_block_hashes=[bytes(h) for h in self.hashes], check_request_ids=self.check_rids,
                check_at=self.check_at, check_num_computed_tokens=self.check_computed,
                check_num_new_tokens=self.check_new, check_num_lookahead_tokens=self.check_look,
                check_num_tokens=self.check_tokens,
            )
        )  # fmt: skip

    def answered(self, answer: pb.AllocateRunResult) -> list[int] | None:
        """Take the answer: None when it does not fit the run, else the entries whose
        block counts differ from what their bounds expected."""
        counts = list(answer.num_new_blocks)
        new_ids = list(answer.new_block_ids)
        if len(counts) != self.num_groups * len(self.rids) or sum(counts) != len(new_ids):
            return None
        self.counts, self.new_ids = counts, new_ids
        self.starts = list(itertools.accumulate(counts, initial=0))
        if counts == self.expected:
            return []
        ng = self.num_groups
        expected = self.expected
        return [
            k
            for k in range(len(self.rids))
            if any(
                e not in (-1, c)
                for e, c in zip(expected[k * ng : (k + 1) * ng], counts[k * ng : (k + 1) * ng], strict=True)
            )
        ]

    def ids_of(self, index: int) -> tuple[list[int], ...]:
        """Entry ``index``'s new block ids per group (the answer must be in)."""
        ng, s, ids = self.num_groups, self.starts, self.new_ids
        at = index * ng
        if ng == 1:
            return (ids[s[at] : s[at + 1]],)
        return tuple(ids[s[at + g] : s[at + g + 1]] for g in range(ng))


def _no_decode(result: Any) -> Any:  # a run's answer is taken by Run.answered
    raise AssertionError("a run is answered by Run.answered")


def ids(groups: Iterable[pb.BlockIds]) -> KVCacheBlockIds:
    return KVCacheBlockIds(tuple(list(g.block_ids) for g in groups))


@dataclasses.dataclass(slots=True)
class Item:
    """One queued operation: the op, how to read its result, the requests whose
    positions it moves, and who waits for it."""

    op: pb.Operation
    #: reads the answer: an OperationResult, or a run entry's block ids per group
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
    #: the run of promised allocations this item sends (its op is built at sending)
    run: Run | None = None
