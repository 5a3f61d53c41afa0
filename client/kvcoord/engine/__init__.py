"""kvcoord's allocator engine: vLLM v1's KV cache manager, pure and deterministic.

No gRPC, no I/O, no clock, no environment: the service drives it and turns its
results and events into messages, logs and metrics.
"""

from .config import KVCacheConfig, attention_groups
from .decode_run import Counts
from .errors import (
    ConfigError,
    EngineError,
    ErrorStatus,
    FailedPreconditionError,
    HintMismatchError,
    HitBlockTakenError,
    InvalidArgumentError,
    RequestExistsError,
    RequestNotFoundError,
    StaleCacheHitError,
    UncountedBlocksError,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, hash_to_int64
from .pool import AllocationResult, CacheHit, KVCachePool, PoolSnapshot, RequestCheckpoint, RequestRewind
from .request import LoRA
from .request_table import BytesHashes, HandedTokenIds, TokenIds
from .specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from .stats import LookupCounters, PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "AllocationResult",
    "AttentionSpec",
    "BlockRemoved",
    "BlockStored",
    "CacheHit",
    "ChunkedLocalAttentionSpec",
    "ConfigError",
    "Counts",
    "CrossAttentionSpec",
    "EngineError",
    "ErrorStatus",
    "FailedPreconditionError",
    "FullAttentionSpec",
    "HintMismatchError",
    "InvalidArgumentError",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCachePool",
    "LoRA",
    "LookupCounters",
    "MambaCacheMode",
    "MambaSpec",
    "PoolSnapshot",
    "PrefixCacheStats",
    "RequestCheckpoint",
    "RequestRewind",
    "RequestExistsError",
    "RequestNotFoundError",
    "SlidingWindowSpec",
    "StaleCacheHitError",
    "UncountedBlocksError",
    "HitBlockTakenError",
    "BytesHashes",
    "HandedTokenIds",
    "TokenIds",
    "attention_groups",
    "hash_to_int64",
]
