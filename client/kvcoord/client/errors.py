"""Typed errors for kvcoord calls, made from gRPC statuses through one registry.

Hierarchy::

    KVCoordError                      every failed call; .code is the grpc.StatusCode
    ├── InvalidArgumentError          INVALID_ARGUMENT, OUT_OF_RANGE
    │   ├── KeyReusedError            an idempotency key reused with another body (KEY_REUSED)
    │   └── FenceUnprovenError        a fence position the server never issued (FENCE_UNPROVEN)
    ├── NotFoundError                 NOT_FOUND
    │   ├── SessionExpiredError       the session is gone; its requests were freed (SESSION_EXPIRED)
    │   └── RequestUnknownError       the request is not in the pool (REQUEST_UNKNOWN)
    ├── AlreadyExistsError            ALREADY_EXISTS
    ├── FailedPreconditionError       FAILED_PRECONDITION (hash handshake, ...)
    │   ├── HashMismatchError         the pool hashes differently (Attach, HASH_MISMATCH)
    │   │   └── ProfileMismatchError  the pool follows another vLLM profile (PROFILE_MISMATCH)
    │   ├── FencedError               server restarted / pool re-created: block ids void
    │   ├── PoolBusyError             an exclusive session holds the pool (POOL_EXCLUSIVE)
    │   ├── NotOwnerError             another replica serves the pool (NOT_OWNER; .owner, .owner_replica)
    │   ├── OwnerGoneError            DeletePool: the pool's owner is gone, nothing deleted (OWNER_GONE)
    │   └── SyncMismatchError         the server holds another position of a request
    ├── PermissionDeniedError         PERMISSION_DENIED, UNAUTHENTICATED
    ├── ResourceExhaustedError        RESOURCE_EXHAUSTED (server limits)
    ├── AbortedError                  ABORTED (a Step operation after a failed one)
    │   └── AnswerEvictedError        applied, but the answer is gone (ANSWER_EVICTED)
    ├── UnavailableError              UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED (transient)
    │   ├── GracePeriodError          the server restarted and waits for old leases (GRACE_PERIOD)
    │   ├── OwnerChangingError        the pool is changing owner at this replica: retry there (OWNER_CHANGING)
    │   ├── WrongReplicaError         the address is not the named replica's any more (WRONG_REPLICA)
    │   └── OutcomeUnknownError       a call may or may not have been applied (retries ran out)
    ├── LeaseExpiredError             the client can no longer vouch for its session lease
    ├── RequestsLostError             RemoteKVCacheManager: these requests are gone; recompute them
    └── InternalError                 INTERNAL, UNKNOWN and anything else

Running out of free blocks is not an error: allocate_slots returns ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "AnswerEvictedError",
    "FailedPreconditionError",
    "FenceUnprovenError",
    "FencedError",
    "GracePeriodError",
    "HashMismatchError",
    "ProfileMismatchError",
    "InternalError",
    "InvalidArgumentError",
    "KVCoordError",
    "KeyReusedError",
    "LocalRpcError",
    "LeaseExpiredError",
    "NotOwnerError",
    "OwnerChangingError",
    "NotFoundError",
    "OwnerGoneError",
    "OutcomeUnknownError",
    "PermissionDeniedError",
    "PoolBusyError",
    "RequestUnknownError",
    "RequestsLostError",
    "ResourceExhaustedError",
    "SessionExpiredError",
    "SyncMismatchError",
    "UnavailableError",
    "WrongReplicaError",
    "error_from_code",
    "error_from_rpc",
    "never_sent",
    "status_code",
]


class KVCoordError(Exception):
    """A failed kvcoord call; ``reason`` is the server's ErrorReason name, if any;
    ``address``: the ``host:port`` its last attempt went to ("" when none was made), the
    replica whose answer this is (in a cluster: which one said it)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.address = ""


class InvalidArgumentError(KVCoordError):
    pass


class NotFoundError(KVCoordError):
    pass


class AlreadyExistsError(KVCoordError):
    pass


class FailedPreconditionError(KVCoordError):
    pass


class HashMismatchError(FailedPreconditionError):
    """The pool records another hash algorithm, block size or seed than the client's."""


class ProfileMismatchError(HashMismatchError):
    """The pool follows another semantics profile (vLLM release) than the client:
    its block hashes and the pool's answers would not agree."""


class PermissionDeniedError(KVCoordError):
    pass


class ResourceExhaustedError(KVCoordError):
    pass


class AbortedError(KVCoordError):
    pass


class UnavailableError(KVCoordError):
    pass


class InternalError(KVCoordError):
    pass


class KeyReusedError(InvalidArgumentError):
    """An idempotency key was used again with another request body or RPC."""


class FenceUnprovenError(InvalidArgumentError):
    """The fence names a journal position beyond what the server's journal holds
    without the ``position_tag`` the server gave with it (altered, or another server's):
    it proves nothing and nothing changed. Send fences back as answers gave them."""


class SessionExpiredError(NotFoundError):
    """The session is unknown or its lease ran out: every request it owned was freed."""


class RequestUnknownError(NotFoundError):
    """The request is not registered in the pool (never, or not any more)."""


class FencedError(FailedPreconditionError):
    """The server restarted or the pool was re-created: every block id held there is void."""


class PoolBusyError(FailedPreconditionError):
    """Attach refused: the pool has an exclusive session, or an exclusive session was
    asked for while others are attached, or a pool with fine-grained (partial) hits has
    a session already."""


class NotOwnerError(FailedPreconditionError):
    """Pools are sharded over replicas and another one serves this pool: ``owner`` is
    its address (host:port; "" if the server named none), ``owner_replica`` its
    ``"<cluster>/<replica id>"`` (sent with the calls made there). Nothing changed."""

    owner = ""
    owner_replica = ""


class OwnerGoneError(FailedPreconditionError):
    """DeletePool in a cluster whose journals are local: the pool's owner stopped
    without handing it over and holds its state on its own disk. Nothing was deleted
    (a definite answer): start that replica again, then delete."""


class SyncMismatchError(FailedPreconditionError):
    """The server holds the request at another position than the client believed."""


class AnswerEvictedError(AbortedError):
    """The call was applied but its answer is no longer kept (dropped within the server's
    idempotency budget, or larger than its max_message_bytes): its outcome is unknown."""


class GracePeriodError(UnavailableError):
    """The server restarted and hands out no block until old leases have ended."""


class OwnerChangingError(UnavailableError):
    """Pools are sharded over replicas and the one called is taking the pool over (its
    owner is gone), rebuilding it, or handing it over: nothing was applied. The client
    keeps this replica as the pool's owner and asks it again shortly."""


class WrongReplicaError(UnavailableError):
    """The server at the address a redirect named is not the replica it named (that
    replica stopped or moved, and another server listens there now, perhaps of another
    cluster): it refused the call, nothing applied or read. The client asks another
    replica of its set."""


class OutcomeUnknownError(UnavailableError):
    """A mutating call may or may not have been applied, and retrying it with the same
    idempotency key did not settle it within the retry horizon."""


class LeaseExpiredError(KVCoordError):
    """The session's lease may have ended (no renewal was acknowledged in time): block
    ids received under it must not be used any more."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message, "LEASE_EXPIRED")


class RequestsLostError(KVCoordError):
    """These requests are no longer allocated on the server (session lost, server
    restarted, or an outcome that could not be settled): preempt and recompute them.
    The manager has already re-attached or cleaned up; the next call works."""

    def __init__(self, request_ids: list[str], cause: KVCoordError) -> None:
        super().__init__(
            cause.code,
            f"{len(request_ids)} request(s) lost ({cause.message[:300]}): {request_ids[:20]}",
            cause.reason,
        )
        self.request_ids = request_ids
        self.cause = cause


_REGISTRY: dict[grpc.StatusCode, type[KVCoordError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    # The client never cancels its own calls: CANCELLED comes from a server that stopped
    # serving mid-call (a failed journal or lease-marker write) or a proxy, so the call
    # may or may not have been applied.
    grpc.StatusCode.CANCELLED: UnavailableError,
}


# Codes that mean something more specific for one RPC.
_RPC_OVERRIDES: dict[tuple[str, grpc.StatusCode], type[KVCoordError]] = {
    ("Attach", grpc.StatusCode.FAILED_PRECONDITION): HashMismatchError,
}


#: The server's ErrorReason names that mean something more specific than the code.
_REASONS: dict[str, type[KVCoordError]] = {
    "INSTANCE_CHANGED": FencedError,
    "INCARNATION_CHANGED": FencedError,
    "SESSION_EXPIRED": SessionExpiredError,
    "SYNC_MISMATCH": SyncMismatchError,
    "KEY_REUSED": KeyReusedError,
    "FENCE_UNPROVEN": FenceUnprovenError,
    "ANSWER_EVICTED": AnswerEvictedError,
    "GRACE_PERIOD": GracePeriodError,
    "REQUEST_UNKNOWN": RequestUnknownError,
    "POOL_EXCLUSIVE": PoolBusyError,
    "HASH_MISMATCH": HashMismatchError,
    "NOT_OWNER": NotOwnerError,
    "OWNER_GONE": OwnerGoneError,
    "PROFILE_MISMATCH": ProfileMismatchError,
    "OWNER_CHANGING": OwnerChangingError,
    "WRONG_REPLICA": WrongReplicaError,
}

#: Trailing-metadata key carrying the reason of a failed RPC.
REASON_METADATA_KEY = "kvcoord-reason"
#: Trailing-metadata key carrying the owner's address with NOT_OWNER.
OWNER_METADATA_KEY = "kvcoord-owner"
#: Trailing-metadata key carrying the owner's "<cluster>/<replica id>" with NOT_OWNER.
OWNER_REPLICA_METADATA_KEY = "kvcoord-owner-replica"
#: Request-metadata key naming the replica a call is meant for (WRONG_REPLICA).
REPLICA_METADATA_KEY = "kvcoord-replica"


def error_from_code(code: grpc.StatusCode, message: str, rpc: str = "", reason: str = "") -> KVCoordError:
    """The typed error for a status code and reason (of ``rpc``, when given)."""
    cls = _REASONS.get(reason) or _RPC_OVERRIDES.get((rpc, code)) or _REGISTRY.get(code, InternalError)
    return cls(code, message, reason)


def error_from_rpc(exc: grpc.RpcError, rpc: str = "") -> KVCoordError:
    """The typed error for a failed gRPC call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    reason = owner = replica = ""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        text = value if isinstance(value, str) else value.decode(errors="replace")
        if key == REASON_METADATA_KEY:
            reason = text
        elif key == OWNER_METADATA_KEY:
            owner = text
        elif key == OWNER_REPLICA_METADATA_KEY:
            replica = text
    err = error_from_code(code or grpc.StatusCode.UNKNOWN, details or "", rpc, reason)
    if isinstance(err, NotOwnerError):
        err.owner, err.owner_replica = owner, replica
    return err


#: how gRPC's UNAVAILABLE begins when the call was never sent: no connection to the
#: target could be made (a replica that is down, a missing unix socket), or its name
#: did not resolve (gRPC's native resolver: "errors resolving"; c-ares: "DNS
#: resolution failed"). gRPC writes nothing before a connection is up, so such a call
#: can go to another replica whatever its kind, and applied nothing anywhere. Any
#: other UNAVAILABLE (a connection reset, a server stopping mid-call) may have been
#: applied. Only the text tells (grpcio 1.85.4: "failed to connect to all addresses;
#: last error: ...", "errors resolving <name>: ..."; its debug_error_string() is the
#: same text, for a status a server sent too), so any other wording (a gRPC that
#: rewords these, round_robin's "connections to all backends failing", the words
#: relayed inside another message) is taken as maybe applied: an unknown outcome,
#: never "not sent" (tests/service/test_never_sent_wording.py). The text is the last
#: gRPC attempt's: this holds because the client's channels carry no service config
#: (gRPC retries nothing of its own but streams no server saw); a retryPolicy (an
#: ``xds:`` target's route) could hide an applied attempt behind a later one's.
_NOT_SENT = ("failed to connect to all addresses", "errors resolving ", "DNS resolution failed")


def never_sent(err: KVCoordError) -> bool:
    """``err`` says the call applied nothing anywhere: it never left the client (no
    connection to the target, or its name did not resolve), or the server it reached
    refused it as meant for another replica (WrongReplicaError) before reading it."""
    return isinstance(err, WrongReplicaError) or (
        err.code == grpc.StatusCode.UNAVAILABLE and err.message.startswith(_NOT_SENT)
    )


#: how gRPC's RESOURCE_EXHAUSTED reads when a message was over a receive limit; the
#: server's refusal of a request over its own limit says "SERVER:" before it
_OVER_LIMIT = "Received message larger than max"


def answer_over_limit(err: KVCoordError) -> bool:
    """``err`` is this client's gRPC refusing an *answer* larger than its own
    ``max_message_bytes`` (set below the server's, which bounds every answer): the
    server applied the call and answered it. The server refusing a request over its
    limit (applied nothing) says "SERVER:" and is not this; a gRPC that names neither
    side is taken as this (a loud unknown outcome, never a silent "not applied")."""
    return (
        err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and _OVER_LIMIT in err.message
        and "SERVER:" not in err.message
    )


#: every StatusCode by its integer value
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode with this integer value (UNKNOWN for an unknown one)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class LocalRpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """A failed call the client itself reports (a Step stream's timeout, an injected
    fault in tests): its code and details, no trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def initial_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        # an outer interceptor's continuation returns this error as the call's outcome
        raise self
