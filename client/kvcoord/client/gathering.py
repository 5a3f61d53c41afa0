"""How the predicted mode gathers a scheduler step's calls into one Step: each call's
operation, written in place into the Step's request, with what the mirror says its answer
must be; allocations of registered requests without a hit as the columns of one run
(written on the sender thread). :class:`~.sender.StepSender` sends what is gathered."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcoord.v1 import allocator_pb2 as pb

from .items import ColumnRun, Gathered
from .mirror import BlockIds

if TYPE_CHECKING:
    from .client import KVCoordClient

__all__ = ["StepGathering"]


class StepGathering:
    """The Step a predicted session is gathering (the scheduler's thread appends to it);
    :class:`~.sender.StepSender`'s part that knows nothing of sending."""

    #: the Step being gathered
    pending: Gathered
    #: the run of allocations being gathered (the Step's next operation)
    run: ColumnRun | None
    #: scheduler steps whose calls joined the Step being gathered
    backlog: int
    #: the session's client (its ``step_piece_ops``: the server's max_ops_per_step)
    client: KVCoordClient

    def op(self) -> pb.Operation:
        """The next operation of the Step being gathered (:meth:`expect` says what its
        answer must be, if anything)."""
        self.close_run()
        pending = self.pending
        pending.expected.append(None)
        pending.size += 32
        return pending.request.ops.add()

    def expect(self, kind: str, value: Any) -> None:
        """What the last operation's answer must be (see ``Gathered.expected``)."""
        self.pending.expected[-1] = (kind, value)

    def grew(self, num_tokens: int, num_hashes: int) -> None:
        """The last operation carries this many appended tokens and hashes (its size counts)."""
        self.pending.size += 5 * num_tokens + 34 * num_hashes

    def later(self, write: Callable[[], object]) -> None:
        """Fields of the last operation that ``write`` sets on the sender thread, just
        before the Step is sent (a request sync's tokens and hashes, a lookup's answer)."""
        pending = self.pending
        pending.writes.append((len(pending.request.ops) - 1, write))

    def take_back(self) -> None:
        """Drop the last operation (refused before it was sent)."""
        pending = self.pending
        ops = pending.request.ops
        if pending.writes and pending.writes[-1][0] == len(ops) - 1:
            pending.writes.pop()
        del ops[-1]
        pending.expected.pop()

    def add_to_run(
        self, rid: str, base_t: int, base_h: int, tokens: Sequence[int], hashes: Sequence[bytes], computed: int,
        num_new_tokens: int, num_lookahead_tokens: int, new: BlockIds,
    ) -> None:  # fmt: skip
        """An allocation of a registered request without a hit (``RequestTracker.sync_run``'s
        values and the call's counts), and the new blocks the mirror gave it: an entry of
        the run being gathered (``tokens`` and ``hashes`` are copied into its columns)."""
        run = self.run
        if run is None or len(run.news) == self.client.step_piece_ops:
            run = self._new_run()
        # (every running request's step: its values appended here, no call made)
        run.fixed += (
            rid,
            base_t,
            base_h,
            computed,
            num_new_tokens,
            num_lookahead_tokens,
            len(tokens),
            len(hashes),
        )
        run.tokens += tokens
        if hashes:
            run.hashes += hashes
        run.news.append(new)
        run.size += 32 + 5 * len(tokens) + 34 * len(hashes)

    def add_decode(
        self, rid: str, base_t: int, base_h: int, token: int, computed: int, num_new_tokens: int,
        num_lookahead_tokens: int, new: BlockIds,
    ) -> None:  # fmt: skip
        """:meth:`add_to_run` of a decode step inside its blocks (one token appended,
        no hash: every running request's step), its size counted without measuring it."""
        run = self.run
        if run is None or len(run.news) == self.client.step_piece_ops:
            run = self._new_run()
        run.fixed += (rid, base_t, base_h, computed, num_new_tokens, num_lookahead_tokens, 1, 0)
        run.tokens.append(token)
        run.news.append(new)
        run.size += 37  # (add_to_run's 32 + 5 per token + 34 per hash)

    def add_step(
        self, rid: str, base_t: int, base_h: int, token: int, block_hash: bytes | None, computed: int,
        num_new_tokens: int, num_lookahead_tokens: int, new: BlockIds,
    ) -> None:  # fmt: skip
        """:meth:`add_to_run` of a decode step taking or caching a block: one token
        appended and the hash of the block it completes (``None``: none), appended to
        the columns as they are, with no tuple made to carry either."""
        run = self.run
        if run is None or len(run.news) == self.client.step_piece_ops:
            run = self._new_run()
        if block_hash is None:
            run.fixed += (rid, base_t, base_h, computed, num_new_tokens, num_lookahead_tokens, 1, 0)
            run.size += 37
        else:
            run.fixed += (rid, base_t, base_h, computed, num_new_tokens, num_lookahead_tokens, 1, 1)
            run.hashes.append(block_hash)
            run.size += 71  # (add_to_run's 32 + 5 per token + 34 per hash)
        run.tokens.append(token)
        run.news.append(new)

    def _new_run(self) -> ColumnRun:
        """Start a run (the one being gathered, if any, ended): a run holds at most the
        server's max_ops_per_step entries (``step_piece_ops``, learned at Attach; 0: no
        bound), the most a DecodeOp's or an AllocateRunOp's request_ids may (a longer
        one is refused whole, every request lost, at every step as large)."""
        self.close_run()
        run = self.run = ColumnRun()
        return run

    def refuse(
        self, rid: str, base_t: int, base_h: int, tokens: Sequence[int], hashes: Sequence[bytes], computed: int,
        num_new_tokens: int, num_lookahead_tokens: int,
    ) -> None:  # fmt: skip
        """A refused allocation of a registered request (as :meth:`add_to_run`'s), for
        the server to confirm."""
        a = self.op().allocate
        sync = a.request
        sync.request_id = rid
        sync.base_num_tokens, sync.base_num_hashes = base_t, base_h
        sync.append_token_ids.extend(tokens)
        sync.append_block_hashes.extend([bytes(h) for h in hashes])
        sync.num_computed_tokens = computed
        a.num_new_tokens = num_new_tokens
        a.num_lookahead_tokens = num_lookahead_tokens
        a.must_refuse = True
        self.grew(len(tokens), len(hashes))

    def close_run(self) -> None:
        """End the run being gathered: it takes the Step's next operation (its columns
        are written when the Step is sent)."""
        run = self.run
        if run is not None:
            pending = self.pending
            pending.runs.append((pending.request.ops.add(), run))
            pending.size += run.size
            pending.expected.append(run)
            self.run = None

    def discard(self) -> None:
        """Forget everything gathered (the session is gone)."""
        self.pending = Gathered()
        self.run = None
        self.backlog = 0
