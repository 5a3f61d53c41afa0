"""kvcoord's client library: what inference workers import.

It needs grpcio, protobuf and the generated ``kvcoord.v1`` stubs, and nothing from the
server side.
"""

from .client import AsyncKVCoordClient, KVCoordClient
from .errors import (
    AbortedError,
    AlreadyExistsError,
    FailedPreconditionError,
    HashMismatchError,
    InternalError,
    InvalidArgumentError,
    KVCoordError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from .hashing import BlockHasher, MultiModalItem, RandomSeedError, none_hash
from .manager import KVCacheBlockIds, Pending, RemoteKVCacheManager, StepBatcher
from .retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy
from .tls import TLSOptions

__all__ = [
    "DEFAULT_RETRY",
    "NO_RETRY",
    "AbortedError",
    "AlreadyExistsError",
    "AsyncKVCoordClient",
    "BlockHasher",
    "FailedPreconditionError",
    "HashMismatchError",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheBlockIds",
    "KVCoordClient",
    "KVCoordError",
    "MultiModalItem",
    "NotFoundError",
    "Pending",
    "PermissionDeniedError",
    "RandomSeedError",
    "RemoteKVCacheManager",
    "ResourceExhaustedError",
    "RetryPolicy",
    "StepBatcher",
    "TLSOptions",
    "UnavailableError",
    "none_hash",
]
