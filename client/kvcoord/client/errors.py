"""Typed errors for kvcoord calls, made from gRPC statuses through one registry.

Hierarchy::

    KVCoordError                      every failed call; .code is the grpc.StatusCode
    ├── InvalidArgumentError          INVALID_ARGUMENT, OUT_OF_RANGE
    ├── NotFoundError                 NOT_FOUND
    ├── AlreadyExistsError            ALREADY_EXISTS
    ├── FailedPreconditionError       FAILED_PRECONDITION (hash handshake, stale hit, ...)
    │   └── HashMismatchError         the pool hashes differently (Attach)
    ├── PermissionDeniedError         PERMISSION_DENIED, UNAUTHENTICATED
    ├── ResourceExhaustedError        RESOURCE_EXHAUSTED (server limits)
    ├── AbortedError                  ABORTED (a Step operation after a failed one)
    ├── UnavailableError              UNAVAILABLE, DEADLINE_EXCEEDED (transient)
    └── InternalError                 INTERNAL, UNKNOWN and anything else

Running out of free blocks is not an error: allocate_slots returns ``None``.
"""

from __future__ import annotations

import grpc

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "HashMismatchError",
    "InternalError",
    "InvalidArgumentError",
    "KVCoordError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnavailableError",
    "error_from_code",
    "error_from_rpc",
    "status_code",
]


class KVCoordError(Exception):
    """A failed kvcoord call."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


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
}


# Codes that mean something more specific for one RPC.
_RPC_OVERRIDES: dict[tuple[str, grpc.StatusCode], type[KVCoordError]] = {
    ("Attach", grpc.StatusCode.FAILED_PRECONDITION): HashMismatchError,
}


def error_from_code(code: grpc.StatusCode, message: str, rpc: str = "") -> KVCoordError:
    """The typed error for a status code (of ``rpc``, when given)."""
    cls = _RPC_OVERRIDES.get((rpc, code)) or _REGISTRY.get(code, InternalError)
    return cls(code, message)


def error_from_rpc(exc: grpc.RpcError, rpc: str = "") -> KVCoordError:
    """The typed error for a failed gRPC call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_from_code(code or grpc.StatusCode.UNKNOWN, details or "", rpc)


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode with this integer value (UNKNOWN for an unknown one)."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
