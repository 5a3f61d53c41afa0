"""The Step sender of a predicted session: gathers its calls, sends them without
waiting, and checks each answer against what the mirror said.

:class:`StepSender` holds the Step being gathered (one operation per call, written in
place, with the answer the mirror gave it), turns each scheduler step's calls into one
Step sent from a background thread when the step ends (:meth:`cut`), and compares the
answer when it comes: every operation's status, every new block id, the free count,
the KV events (by digest) and the statistics. A failure (a refused operation, a
difference, a failed call) is kept in :attr:`failure` for the facade's next call to
report; nothing is absorbed. While a Step is in flight, the next steps' calls join
the next one, up to ``max_backlog`` steps or ``max_step_bytes``; then :meth:`cut`
waits for the answer in flight first.

The scheduler's thread only appends plain values: a run of allocations is gathered as
Python lists (its columns) and the mirror's events as the engine's values; the sender
thread writes the run's columns into the Step and makes and digests the events'
messages just before it sends.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from kvcoord.engine import KVCacheEvent
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import add_events

from .client import KVCoordClient
from .errors import KVCoordError, error_from_code, status_code
from .mirror import BlockIds
from .session import SessionKeeper

__all__ = ["PredictionMismatchError", "StepSender"]

logger = logging.getLogger(__name__)


class PredictionMismatchError(KVCoordError):
    """The server's answer differs from the mirror's (the cause of a RequestsLostError)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INTERNAL, message, "PREDICTION_FAILED")


class _Sent:
    """One Step's operations (written in place into its request) and what the mirror
    says their answers are."""

    __slots__ = ("events", "expected", "num_free_blocks", "request", "runs", "size", "stats")

    def __init__(self) -> None:
        self.request = pb.StepRequest(include_state=True, events_digest=True)
        #: about how many bytes the request holds (an upper bound for its tokens and hashes)
        self.size = 0
        #: each run of allocations and its operation, whose columns are written on the
        #: sender thread (just before the Step is sent), not on the scheduler's
        self.runs: list[tuple[pb.Operation, _Run]] = []
        #: per op: its Run, None, or (kind, the mirror's answer): "new" (an allocation's
        #: new block ids per group), "reset" or "common_prefix"
        self.expected: list[Any] = []
        self.num_free_blocks = 0
        #: the mirror's events (the engine's values), digested on the sender thread
        self.events: list[KVCacheEvent] = []
        self.stats = pb.PrefixCacheStats()


class StepSender:
    """Sends one exclusive session's Steps and checks their answers.

    Args:
        client: the session's client.
        pool: the pool's name.
        keeper: the session (its id and fence go with each Step; answers renew it).
        compare_events: the pool keeps KV events (their digest is compared).
        compare_stats: the pool keeps statistics (they are compared).
        max_backlog: scheduler steps whose calls may wait for the Step in flight.
    """

    def __init__(
        self,
        client: KVCoordClient,
        pool: str,
        keeper: SessionKeeper,
        *,
        compare_events: bool,
        compare_stats: bool,
        max_backlog: int,
    ) -> None:
        self.client = client
        self.pool = pool
        self.keeper = keeper
        self.compare_events = compare_events
        self.compare_stats = compare_stats
        self.max_backlog = max(0, max_backlog)
        #: a Step gathering more than this many bytes is sent as soon as the one in
        #: flight is answered (well under the server's max_message_bytes, 16 MiB by default)
        self.max_step_bytes = 4 << 20
        self.pending = _Sent()
        #: the run of allocations being gathered (the Step's next operation)
        self.run: _Run | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcoord-predict")
        self.in_flight: concurrent.futures.Future[None] | None = None
        #: scheduler steps whose calls joined the Step being gathered
        self.backlog = 0
        #: why the mirror can no longer be trusted (set by the sender thread), until
        #: the facade reports it
        self.failure: KVCoordError | None = None
        #: Steps sent, the seconds the caller waited for answers, and answers whose
        #: events were not comparable (the server's event buffer wrapped)
        self.steps_sent = 0
        self.waited_seconds = 0.0
        self.events_gaps = 0

    # -- gathering ------------------------------------------------------------------------
    def op(self) -> pb.Operation:
        """The next operation of the Step being gathered (:meth:`expect` says what its
        answer must be, if anything)."""
        self.close_run()
        pending = self.pending
        pending.expected.append(None)
        pending.size += 32
        return pending.request.ops.add()

    def expect(self, kind: str, value: Any) -> None:
        """What the last operation's answer must be (see ``_Sent.expected``)."""
        self.pending.expected[-1] = (kind, value)

    def grew(self, sync: pb.RequestSync) -> None:
        """The last operation carries this request sync (its size counts)."""
        self.pending.size += 5 * len(sync.append_token_ids) + 34 * len(sync.append_block_hashes)

    def take_back(self) -> None:
        """Drop the last operation (refused before it was sent)."""
        del self.pending.request.ops[-1]
        self.pending.expected.pop()

    def add_to_run(
        self, rid: str, base_t: int, base_h: int, tokens: Sequence[int], hashes: Sequence[bytes], computed: int,
        num_new_tokens: int, num_lookahead_tokens: int, new: BlockIds,
    ) -> None:  # fmt: skip
        """An allocation of a registered request without a hit (``RequestTracker.sync_run``'s
        values and the call's counts), and the new blocks the mirror gave it."""
        run = self.run
        if run is None:
            run = self.run = _Run()
        run.rids.append(rid)
        run.base_t.append(base_t)
        run.base_h.append(base_h)
        run.computed.append(computed)
        run.new.append(num_new_tokens)
        run.look.append(num_lookahead_tokens)
        run.num_tokens.append(len(tokens))
        run.tokens += tokens
        if hashes:
            run.hashes += hashes
        run.num_hashes.append(len(hashes))
        for group in new:
            run.num_blocks.append(len(group))
            if group:
                run.block_ids += group

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
        self.grew(sync)

    def close_run(self) -> None:
        """End the run being gathered: it takes the Step's next operation (its columns
        are written when the Step is sent)."""
        run = self.run
        if run is not None:
            pending = self.pending
            pending.runs.append((pending.request.ops.add(), run))
            pending.size += 32 * len(run.rids) + 5 * len(run.tokens) + 34 * len(run.hashes)
            pending.expected.append(run)
            self.run = None

    def discard(self) -> None:
        """Forget everything gathered (the session is gone)."""
        self.pending = _Sent()
        self.run = None
        self.backlog = 0

    # -- sending --------------------------------------------------------------------------
    def cut(
        self, state: Callable[[], tuple[int, list[KVCacheEvent], pb.PrefixCacheStats]], wait: bool = False
    ) -> bool:
        """End a scheduler step: send its calls unless a Step is in flight and the
        backlog allows them to wait. ``state`` gives what the answer must say (the
        mirror's free count, events and statistics), read only when the Step is sent.
        Returns whether a Step is to be sent and was (False: nothing gathered, or it
        waits for the next cut)."""
        self.close_run()
        if not self.pending.request.ops:
            return False
        in_flight = self.in_flight
        if in_flight is not None:
            if (
                not wait
                and not in_flight.done()
                and self.backlog < self.max_backlog
                and self.pending.size < self.max_step_bytes
            ):
                self.backlog += 1
                return False
            self.settle()
        if self.failure is not None:
            return False  # reported (and everything gathered dropped) by the facade first
        sent = self.pending
        self.pending = _Sent()
        sent.num_free_blocks, sent.events, sent.stats = state()
        self.backlog = 0
        self.steps_sent += 1
        request = sent.request
        request.pool = self.pool
        request.session_id = self.keeper.session_id
        request.fence.CopyFrom(self.keeper.fence)
        self.in_flight = self._executor.submit(self._step, sent)
        return True

    def settle(self) -> None:
        """Wait for the Step in flight (its failure, if any, is in :attr:`failure`)."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            t0 = time.perf_counter()
            in_flight.result()
            self.waited_seconds += time.perf_counter() - t0

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _step(self, sent: _Sent) -> None:
        """On the sender thread: one Step, its answer compared with the mirror's; a
        failure is kept for the caller's next call to report."""
        try:
            self._checked_step(sent)
        except KVCoordError as err:
            self.failure = self.failure or err
        except Exception as err:  # noqa: BLE001 - anything unexpected is a failure too
            self.failure = self.failure or KVCoordError(grpc.StatusCode.INTERNAL, repr(err))

    def _checked_step(self, sent: _Sent) -> None:
        for op, run in sent.runs:
            run.write(op.allocate_run)
        keeper = self.keeper
        at = keeper.clock()
        resp = self.client.send_step(sent.request)
        keeper.renewed(at)
        keeper.adopt(resp.fence)
        for i, (result, expected) in enumerate(zip(resp.results, sent.expected, strict=True)):
            if result.status_code:
                reason = pb.ErrorReason.Name(result.reason) if result.reason else ""
                raise error_from_code(status_code(result.status_code), result.status_message, "Step", reason)
            if expected is None:
                continue
            if isinstance(expected, _Run):
                if not expected.matches(result.allocate_run):
                    raise PredictionMismatchError(f"operation {i}: the server's run of allocations differs")
                continue
            kind, value = expected
            if kind == "new":
                got: Any = [list(g.block_ids) for g in result.allocate.new_block_ids]
                value = [list(g) for g in value]
            elif kind == "reset":
                got = bool(result.reset_prefix_cache.result)
            else:
                got = list(result.common_prefix.num_blocks)
            if got != value:
                raise PredictionMismatchError(
                    f"operation {i} ({kind}): the server answered {got}, the mirror {value}"
                )
        if resp.num_free_blocks != sent.num_free_blocks:
            raise PredictionMismatchError(
                f"the server has {resp.num_free_blocks} free blocks, the mirror {sent.num_free_blocks}"
            )
        if self.compare_events:
            if resp.events_gap:
                # The server's event buffer wrapped before this Step's events were taken
                # (an eviction larger than its event_buffer): it digested only the events
                # it still kept, so the digest cannot be compared with the mirror's whole
                # list. That is no disagreement: the block ids, free count and statistics
                # above and below are still compared, and the engine publishes the
                # mirror's events, which are complete.
                self.events_gaps += 1
                logger.info(
                    "predicted pool %r: the server's event buffer wrapped during a Step; its events "
                    "were not compared (everything else was)", self.pool,
                )  # fmt: skip
            elif resp.events_sha256 != _events_digest(sent.events):
                raise PredictionMismatchError("the server's KV events differ from the mirror's")
        if self.compare_stats and resp.prefix_cache_stats != sent.stats:
            raise PredictionMismatchError(
                f"the server's prefix-cache statistics differ from the mirror's: {resp.prefix_cache_stats} "
                f"against {sent.stats}"
            )


def _events_digest(events: list[KVCacheEvent]) -> bytes:
    """SHA-256 of the events as a StepResponse holding only them (what the server digests)."""
    message = pb.StepResponse()
    add_events(message.events, events)
    return hashlib.sha256(message.SerializeToString()).digest()


class _Run:
    """A Step's allocations of registered requests without a hit, gathered as the
    columns of one AllocateRunOp, with the block ids the mirror gave them (the
    columns of its answer)."""

    __slots__ = (
        "base_h", "base_t", "block_ids", "computed", "hashes", "look", "new", "num_blocks", "num_hashes",
        "num_tokens", "rids", "tokens",
    )  # fmt: skip

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.base_t: list[int] = []
        self.base_h: list[int] = []
        self.computed: list[int] = []
        self.new: list[int] = []
        self.look: list[int] = []
        self.num_tokens: list[int] = []
        self.tokens: list[int] = []
        self.num_hashes: list[int] = []
        self.hashes: list[bytes] = []
        #: each entry's new block count per group, and the ids, in entry order
        self.num_blocks: list[int] = []
        self.block_ids: list[int] = []

    def write(self, op: pb.AllocateRunOp) -> None:
        """The entries as ``op``'s columns."""
        op.request_ids.extend(self.rids)
        op.base_num_tokens.extend(self.base_t)
        op.base_num_hashes.extend(self.base_h)
        op.num_computed_tokens.extend(self.computed)
        op.num_new_tokens.extend(self.new)
        op.num_lookahead_tokens.extend(self.look)
        op.num_append_tokens.extend(self.num_tokens)
        op.append_token_ids.extend(self.tokens)
        op.num_append_hashes.extend(self.num_hashes)
        op.append_block_hashes.extend(self.hashes)

    def matches(self, answer: pb.AllocateRunResult) -> bool:
        """Whether the server's answer gives each entry the mirror's blocks."""
        return list(answer.num_new_blocks) == self.num_blocks and list(answer.new_block_ids) == self.block_ids
