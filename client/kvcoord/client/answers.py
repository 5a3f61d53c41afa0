"""What a predicted Step's answer must say: each operation's result against the
mirror's (:func:`check_result`), and the free count, the events' digest
(:func:`kvcoord.wire.events_digest`) and the statistics the mirror had when the Step
was sent (:func:`check_answer`). A difference is a :class:`PredictionMismatchError`; a
failed operation's error is :func:`op_error`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import copies_from_pb, events_digest, stats_to_pb

from .errors import KVCoordError, error_from_code, status_code
from .items import ColumnRun, Gathered

__all__ = ["PredictionMismatchError", "check_answer", "check_result", "op_error"]


class PredictionMismatchError(KVCoordError):
    """The server's answer differs from the mirror's (the cause of a RequestsLostError)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INTERNAL, message, "PREDICTION_FAILED")


def check_result(i: int, result: pb.OperationResult, expected: Any) -> None:
    """Operation ``i``'s result: its error raised, or compared with what the mirror
    answered (``expected``: ``None``, a :class:`ColumnRun`, or ``(kind, value)``)."""
    if result.status_code:
        raise op_error(result)
    if expected is None:
        return
    if isinstance(expected, ColumnRun):
        if not expected.matches(result.decode if result.HasField("decode") else result.allocate_run):
            raise PredictionMismatchError(f"operation {i}: the server's run of allocations differs")
        return
    kind, value = expected
    if kind == "new":
        got: Any = [list(g.block_ids) for g in result.allocate.new_block_ids]
        value = [list(g) for g in value]
    elif kind == "reset":
        got = bool(result.reset_prefix_cache.result)
    elif kind == "copies":  # vLLM 0.33's copy-on-write pairs and retained blocks
        got = copies_from_pb(result.take_kv_cache_block_copies)
        value = ([tuple(c) for c in value[0]], list(value[1]))
    else:
        got = list(result.common_prefix.num_blocks)
    if got != value:
        raise PredictionMismatchError(
            f"operation {i} ({kind}): the server answered {got}, the mirror {value}"
        )


def check_answer(
    resp: pb.StepResponse, sent: Gathered, events: bool, stats: bool, events_gap: Callable[[], None]
) -> None:
    """A predicted Step's answer against what the mirror said when ``sent`` was cut:
    every result (:func:`check_result`), the free count, with ``events`` the events'
    digest, with ``stats`` the statistics, in that order. An answer whose events the
    server could not all digest (``events_gap``: its buffer wrapped) is told to
    ``events_gap`` and the rest still compared."""
    for i, (result, expected) in enumerate(zip(resp.results, sent.expected, strict=True)):
        check_result(i, result, expected)
    if resp.num_free_blocks != sent.num_free_blocks:
        raise PredictionMismatchError(
            f"the server has {resp.num_free_blocks} free blocks, the mirror {sent.num_free_blocks}"
        )
    if events:
        if resp.events_gap:
            events_gap()
        elif resp.events_sha256 != events_digest(sent.events):
            raise PredictionMismatchError("the server's KV events differ from the mirror's")
    if stats:
        want = stats_to_pb(sent.stats)
        if resp.prefix_cache_stats != want:
            raise PredictionMismatchError(
                f"the server's prefix-cache statistics differ from the mirror's: {resp.prefix_cache_stats} "
                f"against {want}"
            )


def op_error(result: pb.OperationResult) -> KVCoordError:
    """The typed error of a failed operation's result (``status_code`` set)."""
    reason = pb.ErrorReason.Name(result.reason) if result.reason else ""
    return error_from_code(status_code(result.status_code), result.status_message, "Step", reason)
