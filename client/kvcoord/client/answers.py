"""What a predicted Step's answer must say: each operation's result against the
mirror's (:func:`check_result`; the digest of the mirror's events the server's must
equal is :func:`kvcoord.wire.events_digest`). A difference is a
:class:`PredictionMismatchError`; a failed operation's error is :func:`op_error`."""

from __future__ import annotations

from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import copies_from_pb

from .errors import KVCoordError, error_from_code, status_code
from .items import ColumnRun

__all__ = ["PredictionMismatchError", "check_result", "op_error"]


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


def op_error(result: pb.OperationResult) -> KVCoordError:
    """The typed error of a failed operation's result (``status_code`` set)."""
    reason = pb.ErrorReason.Name(result.reason) if result.reason else ""
    return error_from_code(status_code(result.status_code), result.status_message, "Step", reason)
