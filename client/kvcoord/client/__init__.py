"""kvcoord's client library: what inference workers import.

It needs grpcio, protobuf and the generated ``kvcoord.v1`` stubs, and nothing from the
server side.
"""

from .aio import AsyncKVCoordClient
from .batch import StepBatcher
from .client import KVCoordClient
from .errors import (
    AbortedError,
    AlreadyExistsError,
    AnswerEvictedError,
    FailedPreconditionError,
    FencedError,
    FenceUnprovenError,
    GracePeriodError,
    HashMismatchError,
    InternalError,
    InvalidArgumentError,
    KeyReusedError,
    KVCoordError,
    LeaseExpiredError,
    NotFoundError,
    NotOwnerError,
    OutcomeUnknownError,
    OwnerChangingError,
    OwnerGoneError,
    PermissionDeniedError,
    PoolBusyError,
    ProfileMismatchError,
    RequestsLostError,
    RequestUnknownError,
    ResourceExhaustedError,
    SessionExpiredError,
    SyncMismatchError,
    UnavailableError,
    WrongReplicaError,
)
from .hashing import BlockHasher, MultiModalItem, RandomSeedError, none_hash
from .items import KVCacheBlockIds, Pending
from .manager import RemoteKVCacheManager
from .predicting import PredictingKVCacheManager, PredictionMismatchError
from .retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy
from .session import SessionKeeper
from .tls import TLSOptions

__all__ = [
    "DEFAULT_RETRY",
    "NO_RETRY",
    "AbortedError",
    "AlreadyExistsError",
    "AnswerEvictedError",
    "AsyncKVCoordClient",
    "BlockHasher",
    "FailedPreconditionError",
    "FencedError",
    "FenceUnprovenError",
    "GracePeriodError",
    "HashMismatchError",
    "NotOwnerError",
    "OwnerChangingError",
    "OwnerGoneError",
    "ProfileMismatchError",
    "InternalError",
    "InvalidArgumentError",
    "KVCacheBlockIds",
    "KVCoordClient",
    "KVCoordError",
    "KeyReusedError",
    "LeaseExpiredError",
    "MultiModalItem",
    "NotFoundError",
    "OutcomeUnknownError",
    "Pending",
    "PermissionDeniedError",
    "PredictingKVCacheManager",
    "PredictionMismatchError",
    "PoolBusyError",
    "RandomSeedError",
    "RemoteKVCacheManager",
    "RequestUnknownError",
    "RequestsLostError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "SessionExpiredError",
    "SessionKeeper",
    "StepBatcher",
    "SyncMismatchError",
    "TLSOptions",
    "UnavailableError",
    "WrongReplicaError",
    "none_hash",
]
