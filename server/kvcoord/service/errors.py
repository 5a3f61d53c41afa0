"""Errors of the service layer and the one table that maps every error to a gRPC status.

The rules modules (pool_service, sessions, idempotency, registry, ...) say what went
wrong with a :class:`Status` of their own and never import gRPC; :data:`_GRPC_CODES`
here is the only place a status becomes a gRPC one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from kvcoord.engine import EngineError, ErrorStatus

from .journal import JournalError

__all__ = [
    "MAX_MESSAGE_CHARS",
    "OWNER_METADATA_KEY",
    "OWNER_REPLICA_METADATA_KEY",
    "REPLICA_METADATA_KEY",
    "REASON_METADATA_KEY",
    "STOPPING_AFTER_JOURNAL_FAILURE",
    "ErrorReason",
    "Position",
    "as_service_error",
    "ServiceError",
    "Status",
    "bounded",
    "grpc_code",
    "map_errors",
    "map_stream_errors",
]

logger = logging.getLogger(__name__)

#: What a client is told once the journal could not be written.
STOPPING_AFTER_JOURNAL_FAILURE = (
    "this server stops serving (the journal cannot be written) and is restarted by its "
    "supervisor: retry with the same idempotency key; a keyless call may or may not have been applied"
)

#: Error messages are cut to this many characters (gRPC metadata is size-limited, and
#: a message echoing a huge input helps nobody).
MAX_MESSAGE_CHARS = 1024
#: Trailing-metadata key carrying an ErrorReason name on a failed RPC.
REASON_METADATA_KEY = "kvcoord-reason"
#: Trailing-metadata key carrying the owner's address with NOT_OWNER.
OWNER_METADATA_KEY = "kvcoord-owner"
#: Trailing-metadata key carrying the owner's "<cluster name>/<replica id>" with NOT_OWNER.
OWNER_REPLICA_METADATA_KEY = "kvcoord-owner-replica"
#: Request-metadata key naming the replica a call is meant for (WRONG_REPLICA).
REPLICA_METADATA_KEY = "kvcoord-replica"


class Status(enum.Enum):
    """What kind of failure the service decided (its gRPC code: :data:`_GRPC_CODES`)."""

    #: the input is wrong whatever the state (INVALID_ARGUMENT)
    INVALID = enum.auto()
    NOT_FOUND = enum.auto()
    ALREADY_EXISTS = enum.auto()
    #: the caller may not do this (PERMISSION_DENIED)
    DENIED = enum.auto()
    #: the caller's credentials are missing or unknown (UNAUTHENTICATED)
    UNAUTHENTICATED = enum.auto()
    #: the state does not allow it (FAILED_PRECONDITION)
    PRECONDITION = enum.auto()
    #: a limit is reached (RESOURCE_EXHAUSTED)
    EXHAUSTED = enum.auto()
    #: retry later (UNAVAILABLE)
    UNAVAILABLE = enum.auto()
    #: the outcome must be treated as lost (ABORTED)
    ABORTED = enum.auto()
    #: a fault of the server itself (INTERNAL)
    INTERNAL = enum.auto()


_GRPC_CODES: dict[Status, grpc.StatusCode] = {
    Status.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Status.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Status.DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Status.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Status.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Status.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Status.ABORTED: grpc.StatusCode.ABORTED,
    Status.INTERNAL: grpc.StatusCode.INTERNAL,
}

#: the engine's statuses as the service's
_ENGINE_STATUSES: dict[ErrorStatus, Status] = {
    ErrorStatus.INVALID_ARGUMENT: Status.INVALID,
    ErrorStatus.NOT_FOUND: Status.NOT_FOUND,
    ErrorStatus.ALREADY_EXISTS: Status.ALREADY_EXISTS,
    ErrorStatus.FAILED_PRECONDITION: Status.PRECONDITION,
}

#: what a client is told of a fault it cannot act on (the traceback is logged)
INTERNAL_MESSAGE = "internal server error (see the server log)"


class ErrorReason(enum.Enum):
    """Why a call failed, when the caller must act on it (the proto's ErrorReason)."""

    INSTANCE_CHANGED = 1
    INCARNATION_CHANGED = 2
    SESSION_EXPIRED = 3
    SYNC_MISMATCH = 4
    KEY_REUSED = 5
    ANSWER_EVICTED = 6
    GRACE_PERIOD = 7
    REQUEST_UNKNOWN = 8
    PREDICTION_FAILED = 9
    POOL_EXCLUSIVE = 10
    HASH_MISMATCH = 11
    ANSWER_TOO_LARGE = 12
    NOT_OWNER = 13
    PROFILE_MISMATCH = 14
    OWNER_CHANGING = 15
    OWNER_GONE = 16
    BLOCK_NOT_RETAINED = 17
    FENCE_UNPROVEN = 18
    UNCOUNTED_BLOCKS = 19
    HIT_BLOCK_TAKEN = 20
    WRONG_REPLICA = 21


@dataclasses.dataclass(frozen=True, slots=True)
class Position:
    """Where a request stands on the server (sent back with SYNC_MISMATCH)."""

    request_id: str
    exists: bool
    num_tokens: int = 0
    num_hashes: int = 0
    num_computed_tokens: int = 0


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    cut = len(message) - (limit - 40)
    return f"{message[: limit - 40]}... ({cut} more characters)"


class ServiceError(Exception):
    """A failure decided by the service (unknown pool, limits, sessions, fencing, auth).

    Args:
        status: what kind of failure (a :class:`Status`; a gRPC code is refused).
        message: for people; cut to MAX_MESSAGE_CHARS on the wire.
        reason: for programs, when the caller must do something particular.
        position: the request's server-side position, with SYNC_MISMATCH / REQUEST_UNKNOWN.
        owner: the owning replica's address, with NOT_OWNER.
        owner_replica: the owning replica's "<cluster name>/<replica id>", with NOT_OWNER.
    """

    def __init__(
        self,
        status: Status,
        message: str,
        reason: ErrorReason | None = None,
        position: Position | None = None,
        owner: str | None = None,
        owner_replica: str = "",
    ) -> None:
        if not isinstance(status, Status):
            raise TypeError(f"ServiceError takes a Status (service/errors.py), not {status!r}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.position = position
        self.owner = owner
        self.owner_replica = owner_replica

    @property
    def code(self) -> grpc.StatusCode:
        """The gRPC status this error is answered with."""
        return _GRPC_CODES[self.status]


def as_service_error(exc: Exception) -> ServiceError:
    """Any exception raised while applying an operation, as the ServiceError its caller
    is answered with: an engine error keeps its status and message; anything else is a
    fault of the server, logged with its traceback and answered INTERNAL."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, EngineError):
        return ServiceError(_ENGINE_STATUSES[exc.status], bounded(str(exc)), engine_reason(exc))
    logger.exception("internal error", exc_info=exc)
    return ServiceError(Status.INTERNAL, INTERNAL_MESSAGE)


def engine_reason(exc: EngineError) -> ErrorReason | None:
    """The reason an engine error is answered with (its own: ``EngineError.reason``,
    which the client's mirror raises too, so the two never differ)."""
    return ErrorReason[exc.reason] if exc.reason else None


def grpc_code(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message an exception becomes on the wire.

    Unknown exceptions become INTERNAL with a generic message; their traceback is
    logged, never sent.
    """
    if isinstance(exc, ServiceError):
        return _GRPC_CODES[exc.status], bounded(exc.message)
    if isinstance(exc, EngineError):
        return _GRPC_CODES[_ENGINE_STATUSES[exc.status]], bounded(str(exc))
    if isinstance(exc, JournalError):
        # Applied in memory, maybe not on disk: the outcome is unknown, and this server
        # stops (server.py). UNAVAILABLE tells the client to retry the same idempotency
        # key against the restarted server, which answers from the journal or applies once.
        return grpc.StatusCode.UNAVAILABLE, bounded(f"{exc}; {STOPPING_AFTER_JOURNAL_FAILURE}")
    logger.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


def _trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    reason = engine_reason(exc) if isinstance(exc, EngineError) else getattr(exc, "reason", None)
    if reason is None:
        return ()
    owner = getattr(exc, "owner", None)
    if owner:
        replica = getattr(exc, "owner_replica", "")
        named = ((OWNER_REPLICA_METADATA_KEY, replica),) if replica else ()
        return ((REASON_METADATA_KEY, reason.name), (OWNER_METADATA_KEY, owner), *named)
    return ((REASON_METADATA_KEY, reason.name),)


T = TypeVar("T")
Handler = Callable[..., Awaitable[T]]


#: the servicer's wait (servicer_core.py) before a call is told each of these reasons
_SETTLED_BY = {ErrorReason.INSTANCE_CHANGED: "restore_fenced", ErrorReason.SESSION_EXPIRED: "sessions_ended"}


async def _once_fenced(servicer: Any, exc: Exception) -> Exception:
    """The error to tell for ``exc``: an INSTANCE_CHANGED only once the servicer's
    ``restore_fenced()`` returns (servicer_core.py: a proven restore's fencing journaled
    and durable; its caller drops its fence on hearing it, and a crash before would
    leave the restored sessions and caches alive with nobody to prove the restore
    again), a SESSION_EXPIRED only once ``sessions_ended()`` does (the lapsed sessions'
    ends journaled and durable: a crash before would bring the session back), else what
    that raised (the journal failed: the server stops)."""
    reason = exc.reason if isinstance(exc, ServiceError) else None
    wait = _SETTLED_BY.get(reason) if reason is not None else None
    settle = getattr(servicer, wait, None) if wait else None  # (servicers without pools have none)
    if settle is None:
        return exc
    try:
        await settle()
    except Exception as failed:  # noqa: BLE001 - told instead
        return failed
    return exc


def map_errors(fn: Handler[T]) -> Handler[T]:
    """Decorate a unary aio handler: raised errors become the mapped gRPC status."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await fn(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            told = await _once_fenced(self, exc)
            code, message = grpc_code(told)
            await context.abort(code, message, _trailers(told))
            raise AssertionError("unreachable") from None

    return wrapper


def map_stream_errors(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Decorate a server-streaming aio handler like :func:`map_errors`."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            async for item in fn(self, request, context):
                yield item
        except Exception as exc:  # noqa: BLE001
            told = await _once_fenced(self, exc)
            code, message = grpc_code(told)
            await context.abort(code, message, _trailers(told))

    return wrapper
