from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    INSTANCE_CHANGED: _ClassVar[ErrorReason]
    INCARNATION_CHANGED: _ClassVar[ErrorReason]
    SESSION_EXPIRED: _ClassVar[ErrorReason]
    SYNC_MISMATCH: _ClassVar[ErrorReason]
    KEY_REUSED: _ClassVar[ErrorReason]
    ANSWER_EVICTED: _ClassVar[ErrorReason]
    GRACE_PERIOD: _ClassVar[ErrorReason]
    REQUEST_UNKNOWN: _ClassVar[ErrorReason]
    PREDICTION_FAILED: _ClassVar[ErrorReason]
    POOL_EXCLUSIVE: _ClassVar[ErrorReason]
    HASH_MISMATCH: _ClassVar[ErrorReason]
    ANSWER_TOO_LARGE: _ClassVar[ErrorReason]
    NOT_OWNER: _ClassVar[ErrorReason]
    PROFILE_MISMATCH: _ClassVar[ErrorReason]
    OWNER_CHANGING: _ClassVar[ErrorReason]
    OWNER_GONE: _ClassVar[ErrorReason]
    BLOCK_NOT_RETAINED: _ClassVar[ErrorReason]
    FENCE_UNPROVEN: _ClassVar[ErrorReason]
    UNCOUNTED_BLOCKS: _ClassVar[ErrorReason]
    HIT_BLOCK_TAKEN: _ClassVar[ErrorReason]
    WRONG_REPLICA: _ClassVar[ErrorReason]
REASON_UNSPECIFIED: ErrorReason
INSTANCE_CHANGED: ErrorReason
INCARNATION_CHANGED: ErrorReason
SESSION_EXPIRED: ErrorReason
SYNC_MISMATCH: ErrorReason
KEY_REUSED: ErrorReason
ANSWER_EVICTED: ErrorReason
GRACE_PERIOD: ErrorReason
REQUEST_UNKNOWN: ErrorReason
PREDICTION_FAILED: ErrorReason
POOL_EXCLUSIVE: ErrorReason
HASH_MISMATCH: ErrorReason
ANSWER_TOO_LARGE: ErrorReason
NOT_OWNER: ErrorReason
PROFILE_MISMATCH: ErrorReason
OWNER_CHANGING: ErrorReason
OWNER_GONE: ErrorReason
BLOCK_NOT_RETAINED: ErrorReason
FENCE_UNPROVEN: ErrorReason
UNCOUNTED_BLOCKS: ErrorReason
HIT_BLOCK_TAKEN: ErrorReason
WRONG_REPLICA: ErrorReason

class FullAttentionSpec(_message.Message):
    __slots__ = ("block_size", "num_kv_heads", "head_size", "dtype", "use_mla", "sink_len")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    USE_MLA_FIELD_NUMBER: _ClassVar[int]
    SINK_LEN_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    use_mla: bool
    sink_len: int
    def __init__(self, block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., use_mla: _Optional[bool] = ..., sink_len: _Optional[int] = ...) -> None: ...

class SlidingWindowSpec(_message.Message):
    __slots__ = ("block_size", "sliding_window", "num_kv_heads", "head_size", "dtype")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    sliding_window: int
    num_kv_heads: int
    head_size: int
    dtype: str
    def __init__(self, block_size: _Optional[int] = ..., sliding_window: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ChunkedLocalAttentionSpec(_message.Message):
    __slots__ = ("block_size", "attention_chunk_size", "num_kv_heads", "head_size", "dtype")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    attention_chunk_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    def __init__(self, block_size: _Optional[int] = ..., attention_chunk_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class MambaSpec(_message.Message):
    __slots__ = ("block_size", "mamba_cache_mode", "num_speculative_blocks", "shape_dims", "dtypes", "num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_DIMS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_CHECKPOINT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHECKPOINT_ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    mamba_cache_mode: str
    num_speculative_blocks: int
    shape_dims: _containers.RepeatedScalarFieldContainer[int]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    num_prefill_checkpoint_blocks: int
    prefill_checkpoint_alignment: int
    def __init__(self, block_size: _Optional[int] = ..., mamba_cache_mode: _Optional[str] = ..., num_speculative_blocks: _Optional[int] = ..., shape_dims: _Optional[_Iterable[int]] = ..., dtypes: _Optional[_Iterable[str]] = ..., num_prefill_checkpoint_blocks: _Optional[int] = ..., prefill_checkpoint_alignment: _Optional[int] = ...) -> None: ...

class CrossAttentionSpec(_message.Message):
    __slots__ = ("block_size", "num_kv_heads", "head_size", "dtype")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    def __init__(self, block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVCacheGroupSpec(_message.Message):
    __slots__ = ("full", "sliding_window", "chunked_local", "mamba", "cross_attention")
    FULL_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FIELD_NUMBER: _ClassVar[int]
    CROSS_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    full: FullAttentionSpec
    sliding_window: SlidingWindowSpec
    chunked_local: ChunkedLocalAttentionSpec
    mamba: MambaSpec
    cross_attention: CrossAttentionSpec
    def __init__(self, full: _Optional[_Union[FullAttentionSpec, _Mapping]] = ..., sliding_window: _Optional[_Union[SlidingWindowSpec, _Mapping]] = ..., chunked_local: _Optional[_Union[ChunkedLocalAttentionSpec, _Mapping]] = ..., mamba: _Optional[_Union[MambaSpec, _Mapping]] = ..., cross_attention: _Optional[_Union[CrossAttentionSpec, _Mapping]] = ...) -> None: ...

class PoolConfig(_message.Message):
    __slots__ = ("num_blocks", "groups", "hash_block_size", "enable_caching", "use_eagle", "enable_kv_cache_events", "log_stats", "max_model_len", "hash_algo", "hash_seed", "shared_cache_tenants", "profile", "num_hash_lookahead_tokens", "max_in_flight_tokens", "scheduler_block_size", "prefix_cache_retention_interval", "needs_kv_cache_zeroing", "mamba_shared_prefix_checkpoint", "eagle_group_ids")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_CACHING_FIELD_NUMBER: _ClassVar[int]
    USE_EAGLE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_KV_CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOG_STATS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    SHARED_CACHE_TENANTS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    NUM_HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RETENTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    NEEDS_KV_CACHE_ZEROING_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SHARED_PREFIX_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    EAGLE_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroupSpec]
    hash_block_size: int
    enable_caching: bool
    use_eagle: bool
    enable_kv_cache_events: bool
    log_stats: bool
    max_model_len: int
    hash_algo: str
    hash_seed: str
    shared_cache_tenants: _containers.RepeatedScalarFieldContainer[str]
    profile: str
    num_hash_lookahead_tokens: int
    max_in_flight_tokens: int
    scheduler_block_size: int
    prefix_cache_retention_interval: int
    needs_kv_cache_zeroing: bool
    mamba_shared_prefix_checkpoint: bool
    eagle_group_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroupSpec, _Mapping]]] = ..., hash_block_size: _Optional[int] = ..., enable_caching: _Optional[bool] = ..., use_eagle: _Optional[bool] = ..., enable_kv_cache_events: _Optional[bool] = ..., log_stats: _Optional[bool] = ..., max_model_len: _Optional[int] = ..., hash_algo: _Optional[str] = ..., hash_seed: _Optional[str] = ..., shared_cache_tenants: _Optional[_Iterable[str]] = ..., profile: _Optional[str] = ..., num_hash_lookahead_tokens: _Optional[int] = ..., max_in_flight_tokens: _Optional[int] = ..., scheduler_block_size: _Optional[int] = ..., prefix_cache_retention_interval: _Optional[int] = ..., needs_kv_cache_zeroing: _Optional[bool] = ..., mamba_shared_prefix_checkpoint: _Optional[bool] = ..., eagle_group_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("instance_id", "incarnation", "position", "term", "position_tag")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    POSITION_TAG_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    incarnation: int
    position: int
    term: int
    position_tag: bytes
    def __init__(self, instance_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., position: _Optional[int] = ..., term: _Optional[int] = ..., position_tag: _Optional[bytes] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "config", "coordinator", "num_free_blocks", "usage", "num_requests", "fence", "replica", "replica_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    config: PoolConfig
    coordinator: str
    num_free_blocks: int
    usage: float
    num_requests: int
    fence: Fence
    replica: str
    replica_name: str
    def __init__(self, name: _Optional[str] = ..., config: _Optional[_Union[PoolConfig, _Mapping]] = ..., coordinator: _Optional[str] = ..., num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_requests: _Optional[int] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., replica: _Optional[str] = ..., replica_name: _Optional[str] = ...) -> None: ...

class CreatePoolRequest(_message.Message):
    __slots__ = ("name", "config")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    config: PoolConfig
    def __init__(self, name: _Optional[str] = ..., config: _Optional[_Union[PoolConfig, _Mapping]] = ...) -> None: ...

class CreatePoolResponse(_message.Message):
    __slots__ = ("pool", "created")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    pool: PoolInfo
    created: bool
    def __init__(self, pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetPoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolInfo
    def __init__(self, pool: _Optional[_Union[PoolInfo, _Mapping]] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class DeletePoolRequest(_message.Message):
    __slots__ = ("name", "force", "session_id", "incarnation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    session_id: str
    incarnation: int
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ..., session_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeletePoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("pool", "hash_algo", "hash_block_size", "hash_seed", "client_name", "lease_seconds", "exclusive", "want_pool_state", "want_engine_state", "profile", "num_hash_lookahead_tokens", "attach_key", "reset_prefix_cache", "previous_fence")
    POOL_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    WANT_POOL_STATE_FIELD_NUMBER: _ClassVar[int]
    WANT_ENGINE_STATE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    NUM_HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTACH_KEY_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FENCE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    hash_algo: str
    hash_block_size: int
    hash_seed: str
    client_name: str
    lease_seconds: float
    exclusive: bool
    want_pool_state: bool
    want_engine_state: bool
    profile: str
    num_hash_lookahead_tokens: int
    attach_key: str
    reset_prefix_cache: bool
    previous_fence: Fence
    def __init__(self, pool: _Optional[str] = ..., hash_algo: _Optional[str] = ..., hash_block_size: _Optional[int] = ..., hash_seed: _Optional[str] = ..., client_name: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., exclusive: _Optional[bool] = ..., want_pool_state: _Optional[bool] = ..., want_engine_state: _Optional[bool] = ..., profile: _Optional[str] = ..., num_hash_lookahead_tokens: _Optional[int] = ..., attach_key: _Optional[str] = ..., reset_prefix_cache: _Optional[bool] = ..., previous_fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("next_fresh", "used_free_blocks", "cached_block_ids", "cached_block_hashes", "engine_state", "engine_state_version", "engine_rules", "cache_namespace")
    NEXT_FRESH_FIELD_NUMBER: _ClassVar[int]
    USED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RULES_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    next_fresh: int
    used_free_blocks: _containers.RepeatedScalarFieldContainer[int]
    cached_block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    engine_state: bytes
    engine_state_version: int
    engine_rules: str
    cache_namespace: str
    def __init__(self, next_fresh: _Optional[int] = ..., used_free_blocks: _Optional[_Iterable[int]] = ..., cached_block_ids: _Optional[_Iterable[int]] = ..., cached_block_hashes: _Optional[_Iterable[bytes]] = ..., engine_state: _Optional[bytes] = ..., engine_state_version: _Optional[int] = ..., engine_rules: _Optional[str] = ..., cache_namespace: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("pool", "session_id", "lease_seconds", "idempotency_window_seconds", "fence", "exclusive", "pool_state", "pool_state_unavailable", "capabilities", "prefix_cache_reset", "max_ops_per_step")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    POOL_STATE_FIELD_NUMBER: _ClassVar[int]
    POOL_STATE_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RESET_FIELD_NUMBER: _ClassVar[int]
    MAX_OPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    pool: PoolInfo
    session_id: str
    lease_seconds: float
    idempotency_window_seconds: float
    fence: Fence
    exclusive: bool
    pool_state: PoolState
    pool_state_unavailable: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_reset: bool
    max_ops_per_step: int
    def __init__(self, pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., session_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., idempotency_window_seconds: _Optional[float] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., exclusive: _Optional[bool] = ..., pool_state: _Optional[_Union[PoolState, _Mapping]] = ..., pool_state_unavailable: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., prefix_cache_reset: _Optional[bool] = ..., max_ops_per_step: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id", "fence", "pool")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    fence: Fence
    pool: str
    def __init__(self, session_id: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., pool: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds", "fence")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    fence: Fence
    def __init__(self, lease_seconds: _Optional[float] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id", "fence", "pool")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    fence: Fence
    pool: str
    def __init__(self, session_id: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., pool: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("num_freed_requests",)
    NUM_FREED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_freed_requests: int
    def __init__(self, num_freed_requests: _Optional[int] = ...) -> None: ...

class LoRA(_message.Message):
    __slots__ = ("adapter_id", "name")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    name: str
    def __init__(self, adapter_id: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class RequestSync(_message.Message):
    __slots__ = ("request_id", "append_token_ids", "append_block_hashes", "new_request", "base_num_tokens", "base_num_hashes", "num_computed_tokens", "lora", "skip_reading_prefix_cache", "num_preemptions", "cache_salt", "mm_items", "prompt_embeds_digests", "num_prompt_tokens", "kv_cache_report_full", "rewind_num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    APPEND_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUEST_FIELD_NUMBER: _ClassVar[int]
    BASE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASE_NUM_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SKIP_READING_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_REPORT_FULL_FIELD_NUMBER: _ClassVar[int]
    REWIND_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    append_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    new_request: bool
    base_num_tokens: int
    base_num_hashes: int
    num_computed_tokens: int
    lora: LoRA
    skip_reading_prefix_cache: bool
    num_preemptions: int
    cache_salt: str
    mm_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    prompt_embeds_digests: _containers.RepeatedScalarFieldContainer[bytes]
    num_prompt_tokens: int
    kv_cache_report_full: bool
    rewind_num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., append_block_hashes: _Optional[_Iterable[bytes]] = ..., new_request: _Optional[bool] = ..., base_num_tokens: _Optional[int] = ..., base_num_hashes: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., lora: _Optional[_Union[LoRA, _Mapping]] = ..., skip_reading_prefix_cache: _Optional[bool] = ..., num_preemptions: _Optional[int] = ..., cache_salt: _Optional[str] = ..., mm_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., prompt_embeds_digests: _Optional[_Iterable[bytes]] = ..., num_prompt_tokens: _Optional[int] = ..., kv_cache_report_full: _Optional[bool] = ..., rewind_num_tokens: _Optional[int] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("identifier", "offset", "length")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    length: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class RequestPosition(_message.Message):
    __slots__ = ("request_id", "exists", "num_tokens", "num_hashes", "num_computed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    exists: bool
    num_tokens: int
    num_hashes: int
    num_computed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., exists: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., num_hashes: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheHit(_message.Message):
    __slots__ = ("groups", "num_tokens")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_tokens: int
    def __init__(self, groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class LookupOp(_message.Message):
    __slots__ = ("request", "hint", "walk_limit", "answered")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    WALK_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    request: RequestSync
    hint: bool
    walk_limit: int
    answered: CacheHit
    def __init__(self, request: _Optional[_Union[RequestSync, _Mapping]] = ..., hint: _Optional[bool] = ..., walk_limit: _Optional[int] = ..., answered: _Optional[_Union[CacheHit, _Mapping]] = ...) -> None: ...

class LookupResult(_message.Message):
    __slots__ = ("hit", "eviction_margin", "shared_prefix_boundary")
    HIT_FIELD_NUMBER: _ClassVar[int]
    EVICTION_MARGIN_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    hit: CacheHit
    eviction_margin: int
    shared_prefix_boundary: int
    def __init__(self, hit: _Optional[_Union[CacheHit, _Mapping]] = ..., eviction_margin: _Optional[int] = ..., shared_prefix_boundary: _Optional[int] = ...) -> None: ...

class AllocateOp(_message.Message):
    __slots__ = ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens", "lookup", "must_succeed", "return_table", "must_refuse", "full_sequence_must_fit", "reserved_blocks", "num_in_flight_tokens", "watermark_blocks", "skip_zeroing_group_ids")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_COMPUTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXTERNAL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELAY_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    MUST_SUCCEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_TABLE_FIELD_NUMBER: _ClassVar[int]
    MUST_REFUSE_FIELD_NUMBER: _ClassVar[int]
    FULL_SEQUENCE_MUST_FIT_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIP_ZEROING_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    request: RequestSync
    num_new_tokens: int
    num_new_computed_tokens: int
    new_computed_blocks: CacheHit
    num_lookahead_tokens: int
    num_external_computed_tokens: int
    delay_cache_blocks: bool
    num_encoder_tokens: int
    lookup: bool
    must_succeed: bool
    return_table: bool
    must_refuse: bool
    full_sequence_must_fit: bool
    reserved_blocks: int
    num_in_flight_tokens: int
    watermark_blocks: int
    skip_zeroing_group_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request: _Optional[_Union[RequestSync, _Mapping]] = ..., num_new_tokens: _Optional[int] = ..., num_new_computed_tokens: _Optional[int] = ..., new_computed_blocks: _Optional[_Union[CacheHit, _Mapping]] = ..., num_lookahead_tokens: _Optional[int] = ..., num_external_computed_tokens: _Optional[int] = ..., delay_cache_blocks: _Optional[bool] = ..., num_encoder_tokens: _Optional[int] = ..., lookup: _Optional[bool] = ..., must_succeed: _Optional[bool] = ..., return_table: _Optional[bool] = ..., must_refuse: _Optional[bool] = ..., full_sequence_must_fit: _Optional[bool] = ..., reserved_blocks: _Optional[int] = ..., num_in_flight_tokens: _Optional[int] = ..., watermark_blocks: _Optional[int] = ..., skip_zeroing_group_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateRunOp(_message.Message):
    __slots__ = ("request_ids", "base_num_tokens", "base_num_hashes", "num_computed_tokens", "num_new_tokens", "num_lookahead_tokens", "num_append_tokens", "append_token_ids", "num_append_hashes", "append_block_hashes", "check_request_ids", "check_at", "check_num_computed_tokens", "check_num_new_tokens", "check_num_lookahead_tokens", "check_num_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BASE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASE_NUM_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_APPEND_HASHES_FIELD_NUMBER: _ClassVar[int]
    APPEND_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHECK_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECK_AT_FIELD_NUMBER: _ClassVar[int]
    CHECK_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECK_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECK_NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECK_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    base_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    base_num_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_lookahead_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_append_tokens: _containers.RepeatedScalarFieldContainer[int]
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_append_hashes: _containers.RepeatedScalarFieldContainer[int]
    append_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    check_request_ids: _containers.RepeatedScalarFieldContainer[str]
    check_at: _containers.RepeatedScalarFieldContainer[int]
    check_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    check_num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    check_num_lookahead_tokens: _containers.RepeatedScalarFieldContainer[int]
    check_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., base_num_tokens: _Optional[_Iterable[int]] = ..., base_num_hashes: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., num_lookahead_tokens: _Optional[_Iterable[int]] = ..., num_append_tokens: _Optional[_Iterable[int]] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., num_append_hashes: _Optional[_Iterable[int]] = ..., append_block_hashes: _Optional[_Iterable[bytes]] = ..., check_request_ids: _Optional[_Iterable[str]] = ..., check_at: _Optional[_Iterable[int]] = ..., check_num_computed_tokens: _Optional[_Iterable[int]] = ..., check_num_new_tokens: _Optional[_Iterable[int]] = ..., check_num_lookahead_tokens: _Optional[_Iterable[int]] = ..., check_num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeOp(_message.Message):
    __slots__ = ("request_ids", "base_num_tokens", "base_num_hashes", "num_computed_tokens", "num_new_tokens", "num_lookahead_tokens", "num_append_tokens", "append_token_ids", "num_append_hashes", "append_block_hashes", "must_succeed", "packed_base_num_tokens", "packed_base_num_hashes", "packed_num_computed_tokens", "packed_num_new_tokens", "packed_num_lookahead_tokens", "packed_num_append_tokens", "packed_append_token_ids", "packed_num_append_hashes", "packed_append_block_hashes", "packed_hash_length")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BASE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASE_NUM_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_APPEND_HASHES_FIELD_NUMBER: _ClassVar[int]
    APPEND_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MUST_SUCCEED_FIELD_NUMBER: _ClassVar[int]
    PACKED_BASE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BASE_NUM_HASHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_APPEND_HASHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_APPEND_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_HASH_LENGTH_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    base_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    base_num_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_lookahead_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_append_tokens: _containers.RepeatedScalarFieldContainer[int]
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_append_hashes: _containers.RepeatedScalarFieldContainer[int]
    append_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    must_succeed: bool
    packed_base_num_tokens: bytes
    packed_base_num_hashes: bytes
    packed_num_computed_tokens: bytes
    packed_num_new_tokens: bytes
    packed_num_lookahead_tokens: bytes
    packed_num_append_tokens: bytes
    packed_append_token_ids: bytes
    packed_num_append_hashes: bytes
    packed_append_block_hashes: bytes
    packed_hash_length: int
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., base_num_tokens: _Optional[_Iterable[int]] = ..., base_num_hashes: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., num_lookahead_tokens: _Optional[_Iterable[int]] = ..., num_append_tokens: _Optional[_Iterable[int]] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., num_append_hashes: _Optional[_Iterable[int]] = ..., append_block_hashes: _Optional[_Iterable[bytes]] = ..., must_succeed: _Optional[bool] = ..., packed_base_num_tokens: _Optional[bytes] = ..., packed_base_num_hashes: _Optional[bytes] = ..., packed_num_computed_tokens: _Optional[bytes] = ..., packed_num_new_tokens: _Optional[bytes] = ..., packed_num_lookahead_tokens: _Optional[bytes] = ..., packed_num_append_tokens: _Optional[bytes] = ..., packed_append_token_ids: _Optional[bytes] = ..., packed_num_append_hashes: _Optional[bytes] = ..., packed_append_block_hashes: _Optional[bytes] = ..., packed_hash_length: _Optional[int] = ...) -> None: ...

class DecodeResult(_message.Message):
    __slots__ = ("num_applied", "num_new_blocks", "new_block_ids", "refused")
    NUM_APPLIED_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    num_applied: int
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    refused: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_applied: _Optional[int] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., refused: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateRunResult(_message.Message):
    __slots__ = ("num_new_blocks", "new_block_ids")
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateResult(_message.Message):
    __slots__ = ("refused", "new_block_ids", "hit", "num_new_tokens", "stale_hit", "table")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STALE_HIT_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    refused: bool
    new_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    hit: CacheHit
    num_new_tokens: int
    stale_hit: bool
    table: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, refused: _Optional[bool] = ..., new_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., hit: _Optional[_Union[CacheHit, _Mapping]] = ..., num_new_tokens: _Optional[int] = ..., stale_hit: _Optional[bool] = ..., table: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class FreeOp(_message.Message):
    __slots__ = ("request_id", "if_held", "all_groups_reversed", "uncomputed_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IF_HELD_FIELD_NUMBER: _ClassVar[int]
    ALL_GROUPS_REVERSED_FIELD_NUMBER: _ClassVar[int]
    UNCOMPUTED_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    if_held: bool
    all_groups_reversed: bool
    uncomputed_from: int
    def __init__(self, request_id: _Optional[str] = ..., if_held: _Optional[bool] = ..., all_groups_reversed: _Optional[bool] = ..., uncomputed_from: _Optional[int] = ...) -> None: ...

class PreemptOp(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CacheBlocksOp(_message.Message):
    __slots__ = ("request", "num_computed_tokens")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request: RequestSync
    num_computed_tokens: int
    def __init__(self, request: _Optional[_Union[RequestSync, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class RemoveSkippedBlocksOp(_message.Message):
    __slots__ = ("request", "total_computed_tokens")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request: RequestSync
    total_computed_tokens: int
    def __init__(self, request: _Optional[_Union[RequestSync, _Mapping]] = ..., total_computed_tokens: _Optional[int] = ...) -> None: ...

class EvictBlocksOp(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetBlockIdsOp(_message.Message):
    __slots__ = ("request_id", "answered", "computed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    answered: GetBlockIdsResult
    computed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., answered: _Optional[_Union[GetBlockIdsResult, _Mapping]] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class GetBlockIdsResult(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class CommonPrefixOp(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CommonPrefixResult(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetPrefixCacheOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResult(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: bool
    def __init__(self, result: _Optional[bool] = ...) -> None: ...

class TakeEventsOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TakeEventsResult(_message.Message):
    __slots__ = ("events", "gap", "more")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    gap: bool
    more: bool
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., gap: _Optional[bool] = ..., more: _Optional[bool] = ...) -> None: ...

class MakePrefixCacheStatsOp(_message.Message):
    __slots__ = ("peek",)
    PEEK_FIELD_NUMBER: _ClassVar[int]
    peek: bool
    def __init__(self, peek: _Optional[bool] = ...) -> None: ...

class PrefixCacheStatsResult(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: PrefixCacheStats
    def __init__(self, stats: _Optional[_Union[PrefixCacheStats, _Mapping]] = ...) -> None: ...

class RecordPrefixCacheStatsOp(_message.Message):
    __slots__ = ("request_id", "num_hits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_hits: int
    def __init__(self, request_id: _Optional[str] = ..., num_hits: _Optional[int] = ...) -> None: ...

class EstimateCachedTokensOp(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class EstimateCachedTokensResult(_message.Message):
    __slots__ = ("num_tokens",)
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    def __init__(self, num_tokens: _Optional[int] = ...) -> None: ...

class NewStepStartsOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNumBlocksToAllocateOp(_message.Message):
    __slots__ = ("request_id", "num_tokens", "total_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "num_encoder_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_MAIN_MODEL_FIELD_NUMBER: _ClassVar[int]
    APPLY_ADMISSION_CAP_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    total_computed_tokens: int
    num_tokens_main_model: int
    apply_admission_cap: bool
    num_encoder_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., total_computed_tokens: _Optional[int] = ..., num_tokens_main_model: _Optional[int] = ..., apply_admission_cap: _Optional[bool] = ..., num_encoder_tokens: _Optional[int] = ...) -> None: ...

class GetNumBlocksToAllocateResult(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class TakeNewBlockIdsOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TakeNewBlockIdsResult(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BoundaryStateOffload(_message.Message):
    __slots__ = ("request_id", "group_id", "block_id", "boundary_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    group_id: int
    block_id: int
    boundary_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., group_id: _Optional[int] = ..., block_id: _Optional[int] = ..., boundary_tokens: _Optional[int] = ...) -> None: ...

class TakeBoundaryStateOffloadsOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TakeBoundaryStateOffloadsResult(_message.Message):
    __slots__ = ("offloads",)
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    offloads: _containers.RepeatedCompositeFieldContainer[BoundaryStateOffload]
    def __init__(self, offloads: _Optional[_Iterable[_Union[BoundaryStateOffload, _Mapping]]] = ...) -> None: ...

class KVCacheBlockCopy(_message.Message):
    __slots__ = ("src_block_id", "dst_block_id")
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    src_block_id: int
    dst_block_id: int
    def __init__(self, src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ...) -> None: ...

class TakeKVCacheBlockCopiesOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TakeKVCacheBlockCopiesResult(_message.Message):
    __slots__ = ("copies", "retained_block_ids")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[KVCacheBlockCopy]
    retained_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, copies: _Optional[_Iterable[_Union[KVCacheBlockCopy, _Mapping]]] = ..., retained_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRetainedBlocksOp(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRetainedBlocksResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DropBoundaryStateOffloadsOp(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DropUncomputedOp(_message.Message):
    __slots__ = ("request_id", "uncomputed_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UNCOMPUTED_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    uncomputed_from: int
    def __init__(self, request_id: _Optional[str] = ..., uncomputed_from: _Optional[int] = ...) -> None: ...

class DropBoundaryStateOffloadsResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RecordBlocksForZeroingOp(_message.Message):
    __slots__ = ("request_id", "start_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_token: int
    def __init__(self, request_id: _Optional[str] = ..., start_token: _Optional[int] = ...) -> None: ...

class RecordBlocksForZeroingResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SyncOp(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: RequestSync
    def __init__(self, request: _Optional[_Union[RequestSync, _Mapping]] = ...) -> None: ...

class AdmitOp(_message.Message):
    __slots__ = ("requests", "token_budget", "num_lookahead_tokens")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestSync]
    token_budget: int
    num_lookahead_tokens: int
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestSync, _Mapping]]] = ..., token_budget: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class AdmitResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AllocateResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AllocateResult, _Mapping]]] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("lookup", "allocate", "free", "preempt", "cache_blocks", "remove_skipped_blocks", "evict_blocks", "get_block_ids", "common_prefix", "reset_prefix_cache", "take_events", "make_prefix_cache_stats", "sync", "admit", "allocate_run", "record_prefix_cache_stats", "estimate_cached_tokens", "new_step_starts", "get_num_blocks_to_allocate", "take_new_block_ids", "take_boundary_state_offloads", "take_kv_cache_block_copies", "release_retained_blocks", "drop_boundary_state_offloads", "decode", "record_blocks_for_zeroing", "drop_uncomputed")
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GET_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMON_PREFIX_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    TAKE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    MAKE_PREFIX_CACHE_STATS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_RUN_FIELD_NUMBER: _ClassVar[int]
    RECORD_PREFIX_CACHE_STATS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_STEP_STARTS_FIELD_NUMBER: _ClassVar[int]
    GET_NUM_BLOCKS_TO_ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    TAKE_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TAKE_BOUNDARY_STATE_OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    TAKE_KV_CACHE_BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROP_BOUNDARY_STATE_OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    RECORD_BLOCKS_FOR_ZEROING_FIELD_NUMBER: _ClassVar[int]
    DROP_UNCOMPUTED_FIELD_NUMBER: _ClassVar[int]
    lookup: LookupOp
    allocate: AllocateOp
    free: FreeOp
    preempt: PreemptOp
    cache_blocks: CacheBlocksOp
    remove_skipped_blocks: RemoveSkippedBlocksOp
    evict_blocks: EvictBlocksOp
    get_block_ids: GetBlockIdsOp
    common_prefix: CommonPrefixOp
    reset_prefix_cache: ResetPrefixCacheOp
    take_events: TakeEventsOp
    make_prefix_cache_stats: MakePrefixCacheStatsOp
    sync: SyncOp
    admit: AdmitOp
    allocate_run: AllocateRunOp
    record_prefix_cache_stats: RecordPrefixCacheStatsOp
    estimate_cached_tokens: EstimateCachedTokensOp
    new_step_starts: NewStepStartsOp
    get_num_blocks_to_allocate: GetNumBlocksToAllocateOp
    take_new_block_ids: TakeNewBlockIdsOp
    take_boundary_state_offloads: TakeBoundaryStateOffloadsOp
    take_kv_cache_block_copies: TakeKVCacheBlockCopiesOp
    release_retained_blocks: ReleaseRetainedBlocksOp
    drop_boundary_state_offloads: DropBoundaryStateOffloadsOp
    decode: DecodeOp
    record_blocks_for_zeroing: RecordBlocksForZeroingOp
    drop_uncomputed: DropUncomputedOp
    def __init__(self, lookup: _Optional[_Union[LookupOp, _Mapping]] = ..., allocate: _Optional[_Union[AllocateOp, _Mapping]] = ..., free: _Optional[_Union[FreeOp, _Mapping]] = ..., preempt: _Optional[_Union[PreemptOp, _Mapping]] = ..., cache_blocks: _Optional[_Union[CacheBlocksOp, _Mapping]] = ..., remove_skipped_blocks: _Optional[_Union[RemoveSkippedBlocksOp, _Mapping]] = ..., evict_blocks: _Optional[_Union[EvictBlocksOp, _Mapping]] = ..., get_block_ids: _Optional[_Union[GetBlockIdsOp, _Mapping]] = ..., common_prefix: _Optional[_Union[CommonPrefixOp, _Mapping]] = ..., reset_prefix_cache: _Optional[_Union[ResetPrefixCacheOp, _Mapping]] = ..., take_events: _Optional[_Union[TakeEventsOp, _Mapping]] = ..., make_prefix_cache_stats: _Optional[_Union[MakePrefixCacheStatsOp, _Mapping]] = ..., sync: _Optional[_Union[SyncOp, _Mapping]] = ..., admit: _Optional[_Union[AdmitOp, _Mapping]] = ..., allocate_run: _Optional[_Union[AllocateRunOp, _Mapping]] = ..., record_prefix_cache_stats: _Optional[_Union[RecordPrefixCacheStatsOp, _Mapping]] = ..., estimate_cached_tokens: _Optional[_Union[EstimateCachedTokensOp, _Mapping]] = ..., new_step_starts: _Optional[_Union[NewStepStartsOp, _Mapping]] = ..., get_num_blocks_to_allocate: _Optional[_Union[GetNumBlocksToAllocateOp, _Mapping]] = ..., take_new_block_ids: _Optional[_Union[TakeNewBlockIdsOp, _Mapping]] = ..., take_boundary_state_offloads: _Optional[_Union[TakeBoundaryStateOffloadsOp, _Mapping]] = ..., take_kv_cache_block_copies: _Optional[_Union[TakeKVCacheBlockCopiesOp, _Mapping]] = ..., release_retained_blocks: _Optional[_Union[ReleaseRetainedBlocksOp, _Mapping]] = ..., drop_boundary_state_offloads: _Optional[_Union[DropBoundaryStateOffloadsOp, _Mapping]] = ..., decode: _Optional[_Union[DecodeOp, _Mapping]] = ..., record_blocks_for_zeroing: _Optional[_Union[RecordBlocksForZeroingOp, _Mapping]] = ..., drop_uncomputed: _Optional[_Union[DropUncomputedOp, _Mapping]] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("status_code", "status_message", "reason", "position", "lookup", "allocate", "get_block_ids", "common_prefix", "reset_prefix_cache", "take_events", "prefix_cache_stats", "admit", "allocate_run", "estimate_cached_tokens", "get_num_blocks_to_allocate", "take_new_block_ids", "take_boundary_state_offloads", "take_kv_cache_block_copies", "release_retained_blocks", "drop_boundary_state_offloads", "decode", "record_blocks_for_zeroing")
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    GET_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMON_PREFIX_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    TAKE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_STATS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_RUN_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GET_NUM_BLOCKS_TO_ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    TAKE_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TAKE_BOUNDARY_STATE_OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    TAKE_KV_CACHE_BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROP_BOUNDARY_STATE_OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    RECORD_BLOCKS_FOR_ZEROING_FIELD_NUMBER: _ClassVar[int]
    status_code: int
    status_message: str
    reason: ErrorReason
    position: RequestPosition
    lookup: LookupResult
    allocate: AllocateResult
    get_block_ids: GetBlockIdsResult
    common_prefix: CommonPrefixResult
    reset_prefix_cache: ResetPrefixCacheResult
    take_events: TakeEventsResult
    prefix_cache_stats: PrefixCacheStatsResult
    admit: AdmitResult
    allocate_run: AllocateRunResult
    estimate_cached_tokens: EstimateCachedTokensResult
    get_num_blocks_to_allocate: GetNumBlocksToAllocateResult
    take_new_block_ids: TakeNewBlockIdsResult
    take_boundary_state_offloads: TakeBoundaryStateOffloadsResult
    take_kv_cache_block_copies: TakeKVCacheBlockCopiesResult
    release_retained_blocks: ReleaseRetainedBlocksResult
    drop_boundary_state_offloads: DropBoundaryStateOffloadsResult
    decode: DecodeResult
    record_blocks_for_zeroing: RecordBlocksForZeroingResult
    def __init__(self, status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., reason: _Optional[_Union[ErrorReason, str]] = ..., position: _Optional[_Union[RequestPosition, _Mapping]] = ..., lookup: _Optional[_Union[LookupResult, _Mapping]] = ..., allocate: _Optional[_Union[AllocateResult, _Mapping]] = ..., get_block_ids: _Optional[_Union[GetBlockIdsResult, _Mapping]] = ..., common_prefix: _Optional[_Union[CommonPrefixResult, _Mapping]] = ..., reset_prefix_cache: _Optional[_Union[ResetPrefixCacheResult, _Mapping]] = ..., take_events: _Optional[_Union[TakeEventsResult, _Mapping]] = ..., prefix_cache_stats: _Optional[_Union[PrefixCacheStatsResult, _Mapping]] = ..., admit: _Optional[_Union[AdmitResult, _Mapping]] = ..., allocate_run: _Optional[_Union[AllocateRunResult, _Mapping]] = ..., estimate_cached_tokens: _Optional[_Union[EstimateCachedTokensResult, _Mapping]] = ..., get_num_blocks_to_allocate: _Optional[_Union[GetNumBlocksToAllocateResult, _Mapping]] = ..., take_new_block_ids: _Optional[_Union[TakeNewBlockIdsResult, _Mapping]] = ..., take_boundary_state_offloads: _Optional[_Union[TakeBoundaryStateOffloadsResult, _Mapping]] = ..., take_kv_cache_block_copies: _Optional[_Union[TakeKVCacheBlockCopiesResult, _Mapping]] = ..., release_retained_blocks: _Optional[_Union[ReleaseRetainedBlocksResult, _Mapping]] = ..., drop_boundary_state_offloads: _Optional[_Union[DropBoundaryStateOffloadsResult, _Mapping]] = ..., decode: _Optional[_Union[DecodeResult, _Mapping]] = ..., record_blocks_for_zeroing: _Optional[_Union[RecordBlocksForZeroingResult, _Mapping]] = ...) -> None: ...

class FindLongestCacheHitRequest(_message.Message):
    __slots__ = ("pool", "block_hashes", "num_tokens")
    POOL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    def __init__(self, pool: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class FindLongestCacheHitResponse(_message.Message):
    __slots__ = ("hit", "num_free_blocks", "fence")
    HIT_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    hit: CacheHit
    num_free_blocks: int
    fence: Fence
    def __init__(self, hit: _Optional[_Union[CacheHit, _Mapping]] = ..., num_free_blocks: _Optional[int] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("pool", "session_id", "op", "idempotency_key", "fence", "call_sequence", "abandoned")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    op: AllocateOp
    idempotency_key: str
    fence: Fence
    call_sequence: int
    abandoned: _containers.RepeatedCompositeFieldContainer[AbandonedCall]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., op: _Optional[_Union[AllocateOp, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., call_sequence: _Optional[int] = ..., abandoned: _Optional[_Iterable[_Union[AbandonedCall, _Mapping]]] = ...) -> None: ...

class AbandonedCall(_message.Message):
    __slots__ = ("idempotency_key", "call_sequence")
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    idempotency_key: str
    call_sequence: int
    def __init__(self, idempotency_key: _Optional[str] = ..., call_sequence: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("result", "num_free_blocks", "usage", "fence")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    result: AllocateResult
    num_free_blocks: int
    usage: float
    fence: Fence
    def __init__(self, result: _Optional[_Union[AllocateResult, _Mapping]] = ..., num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("pool", "session_id", "request_ids", "preempt", "idempotency_key", "fence", "call_sequence", "abandoned")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    preempt: bool
    idempotency_key: str
    fence: Fence
    call_sequence: int
    abandoned: _containers.RepeatedCompositeFieldContainer[AbandonedCall]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., preempt: _Optional[bool] = ..., idempotency_key: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., call_sequence: _Optional[int] = ..., abandoned: _Optional[_Iterable[_Union[AbandonedCall, _Mapping]]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_free_blocks", "fence")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    fence: Fence
    def __init__(self, num_free_blocks: _Optional[int] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool", "session_id", "ops", "idempotency_key", "fence", "include_state", "events_digest", "call_sequence", "abandoned")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STATE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    ops: _containers.RepeatedCompositeFieldContainer[Operation]
    idempotency_key: str
    fence: Fence
    include_state: bool
    events_digest: bool
    call_sequence: int
    abandoned: _containers.RepeatedCompositeFieldContainer[AbandonedCall]
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ..., idempotency_key: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., include_state: _Optional[bool] = ..., events_digest: _Optional[bool] = ..., call_sequence: _Optional[int] = ..., abandoned: _Optional[_Iterable[_Union[AbandonedCall, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "num_free_blocks", "usage", "fence", "events", "events_gap", "prefix_cache_stats", "events_sha256", "events_more")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_GAP_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_STATS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    EVENTS_MORE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[OperationResult]
    num_free_blocks: int
    usage: float
    fence: Fence
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    events_gap: bool
    prefix_cache_stats: PrefixCacheStats
    events_sha256: bytes
    events_more: bool
    def __init__(self, results: _Optional[_Iterable[_Union[OperationResult, _Mapping]]] = ..., num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., events_gap: _Optional[bool] = ..., prefix_cache_stats: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., events_sha256: _Optional[bytes] = ..., events_more: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("pool", "session_id", "fence")
    POOL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    session_id: str
    fence: Fence
    def __init__(self, pool: _Optional[str] = ..., session_id: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("result", "num_free_blocks")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    result: bool
    num_free_blocks: int
    def __init__(self, result: _Optional[bool] = ..., num_free_blocks: _Optional[int] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("reset", "requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")
    RESET_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_HITS_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    requests: int
    queries: int
    hits: int
    preempted_requests: int
    preempted_queries: int
    preempted_hits: int
    def __init__(self, reset: _Optional[bool] = ..., requests: _Optional[int] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., preempted_requests: _Optional[int] = ..., preempted_queries: _Optional[int] = ..., preempted_hits: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_pools", "max_blocks_per_pool", "max_requests_per_pool", "max_ops_per_step", "event_buffer", "max_tokens_per_request", "max_pool_memory_bytes", "pool_memory_bytes", "pool_block_bytes", "pool_token_bytes", "max_sessions_per_tenant", "tenant_sessions", "max_session_lease_seconds", "max_message_bytes", "idempotency_max_bytes", "idempotency_bytes", "idempotency_keys", "server_sessions", "max_name_length", "max_request_id_length", "max_idempotency_key_length", "max_client_name_length")
    MAX_POOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_POOL_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_PER_POOL_FIELD_NUMBER: _ClassVar[int]
    MAX_OPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    EVENT_BUFFER_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_POOL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEYS_FIELD_NUMBER: _ClassVar[int]
    SERVER_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_NAME_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_ID_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_IDEMPOTENCY_KEY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_NAME_LENGTH_FIELD_NUMBER: _ClassVar[int]
    max_pools: int
    max_blocks_per_pool: int
    max_requests_per_pool: int
    max_ops_per_step: int
    event_buffer: int
    max_tokens_per_request: int
    max_pool_memory_bytes: int
    pool_memory_bytes: int
    pool_block_bytes: int
    pool_token_bytes: int
    max_sessions_per_tenant: int
    tenant_sessions: int
    max_session_lease_seconds: float
    max_message_bytes: int
    idempotency_max_bytes: int
    idempotency_bytes: int
    idempotency_keys: int
    server_sessions: int
    max_name_length: int
    max_request_id_length: int
    max_idempotency_key_length: int
    max_client_name_length: int
    def __init__(self, max_pools: _Optional[int] = ..., max_blocks_per_pool: _Optional[int] = ..., max_requests_per_pool: _Optional[int] = ..., max_ops_per_step: _Optional[int] = ..., event_buffer: _Optional[int] = ..., max_tokens_per_request: _Optional[int] = ..., max_pool_memory_bytes: _Optional[int] = ..., pool_memory_bytes: _Optional[int] = ..., pool_block_bytes: _Optional[int] = ..., pool_token_bytes: _Optional[int] = ..., max_sessions_per_tenant: _Optional[int] = ..., tenant_sessions: _Optional[int] = ..., max_session_lease_seconds: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., idempotency_max_bytes: _Optional[int] = ..., idempotency_bytes: _Optional[int] = ..., idempotency_keys: _Optional[int] = ..., server_sessions: _Optional[int] = ..., max_name_length: _Optional[int] = ..., max_request_id_length: _Optional[int] = ..., max_idempotency_key_length: _Optional[int] = ..., max_client_name_length: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_free_blocks", "num_total_blocks", "usage", "num_requests", "prefix_cache_stats", "fence", "limits", "pool_memory_bytes", "event_buffer_bytes", "event_buffer_max_bytes", "reservations", "num_sessions")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_STATS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    POOL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_BUFFER_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    num_total_blocks: int
    usage: float
    num_requests: int
    prefix_cache_stats: PrefixCacheStats
    fence: Fence
    limits: ServerLimits
    pool_memory_bytes: int
    event_buffer_bytes: int
    event_buffer_max_bytes: int
    reservations: ReservationStats
    num_sessions: int
    def __init__(self, num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_requests: _Optional[int] = ..., prefix_cache_stats: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., pool_memory_bytes: _Optional[int] = ..., event_buffer_bytes: _Optional[int] = ..., event_buffer_max_bytes: _Optional[int] = ..., reservations: _Optional[_Union[ReservationStats, _Mapping]] = ..., num_sessions: _Optional[int] = ...) -> None: ...

class CheckPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class CheckPoolResponse(_message.Message):
    __slots__ = ("violations", "num_blocks_checked", "num_requests_checked", "num_cached_blocks", "fence")
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    violations: _containers.RepeatedScalarFieldContainer[str]
    num_blocks_checked: int
    num_requests_checked: int
    num_cached_blocks: int
    fence: Fence
    def __init__(self, violations: _Optional[_Iterable[str]] = ..., num_blocks_checked: _Optional[int] = ..., num_requests_checked: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class InspectPoolRequest(_message.Message):
    __slots__ = ("pool", "free_queue_limit", "request_ids", "all_requests", "include_cached_blocks")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FREE_QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    free_queue_limit: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    all_requests: bool
    include_cached_blocks: bool
    def __init__(self, pool: _Optional[str] = ..., free_queue_limit: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., all_requests: _Optional[bool] = ..., include_cached_blocks: _Optional[bool] = ...) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("request_id", "groups", "num_computed_tokens", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_computed_tokens: int
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_computed_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class InspectPoolResponse(_message.Message):
    __slots__ = ("num_free_blocks", "usage", "free_queue_head", "requests", "cached_block_ids")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FREE_QUEUE_HEAD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    usage: float
    free_queue_head: _containers.RepeatedScalarFieldContainer[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestState]
    cached_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., free_queue_head: _Optional[_Iterable[int]] = ..., requests: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ..., cached_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name", "medium", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "lookahead_token_ids")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_id: int
    lora_name: str
    medium: str
    extra_keys: _containers.RepeatedCompositeFieldContainer[EventExtraKeys]
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int
    lookahead_token_ids: _containers.RepeatedCompositeFieldContainer[EventTokens]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., medium: _Optional[str] = ..., extra_keys: _Optional[_Iterable[_Union[EventExtraKeys, _Mapping]]] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[str] = ..., kv_cache_spec_sliding_window: _Optional[int] = ..., lookahead_token_ids: _Optional[_Iterable[_Union[EventTokens, _Mapping]]] = ...) -> None: ...

class EventTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EventExtraKeys(_message.Message):
    __slots__ = ("present", "keys", "values")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    present: bool
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedCompositeFieldContainer[EventExtraKey]
    def __init__(self, present: _Optional[bool] = ..., keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[_Union[EventExtraKey, _Mapping]]] = ...) -> None: ...

class EventExtraKey(_message.Message):
    __slots__ = ("text", "digest", "mm")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    MM_FIELD_NUMBER: _ClassVar[int]
    text: str
    digest: bytes
    mm: EventMultiModalKey
    def __init__(self, text: _Optional[str] = ..., digest: _Optional[bytes] = ..., mm: _Optional[_Union[EventMultiModalKey, _Mapping]] = ...) -> None: ...

class EventMultiModalKey(_message.Message):
    __slots__ = ("identifier", "offset")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "group_idx")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    group_idx: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool", "after_sequence", "fence")
    POOL_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    after_sequence: int
    fence: Fence
    def __init__(self, pool: _Optional[str] = ..., after_sequence: _Optional[int] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("sequence", "event", "gap", "fence", "reset")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    event: KVEvent
    gap: bool
    fence: Fence
    reset: bool
    def __init__(self, sequence: _Optional[int] = ..., event: _Optional[_Union[KVEvent, _Mapping]] = ..., gap: _Optional[bool] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., reset: _Optional[bool] = ...) -> None: ...

class HashedPrompt(_message.Message):
    __slots__ = ("hash_algo", "hash_block_size", "hash_seed", "block_hashes", "profile", "num_hash_lookahead_tokens")
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    NUM_HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    hash_algo: str
    hash_block_size: int
    hash_seed: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    profile: str
    num_hash_lookahead_tokens: int
    def __init__(self, hash_algo: _Optional[str] = ..., hash_block_size: _Optional[int] = ..., hash_seed: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., profile: _Optional[str] = ..., num_hash_lookahead_tokens: _Optional[int] = ...) -> None: ...

class ScorePoolsRequest(_message.Message):
    __slots__ = ("candidate_pools", "num_tokens", "prompts", "include_block_ids", "reserve_seconds", "idempotency_key")
    CANDIDATE_POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    candidate_pools: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: int
    prompts: _containers.RepeatedCompositeFieldContainer[HashedPrompt]
    include_block_ids: bool
    reserve_seconds: float
    idempotency_key: str
    def __init__(self, candidate_pools: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[HashedPrompt, _Mapping]]] = ..., include_block_ids: _Optional[bool] = ..., reserve_seconds: _Optional[float] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class PoolScore(_message.Message):
    __slots__ = ("pool", "hit_tokens", "num_free_blocks", "usage", "num_total_blocks", "hit", "fence")
    POOL_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    hit_tokens: int
    num_free_blocks: int
    usage: float
    num_total_blocks: int
    hit: CacheHit
    fence: Fence
    def __init__(self, pool: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_total_blocks: _Optional[int] = ..., hit: _Optional[_Union[CacheHit, _Mapping]] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class UnscoredPool(_message.Message):
    __slots__ = ("pool", "reason", "message")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    reason: str
    message: str
    def __init__(self, pool: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ScorePoolsResponse(_message.Message):
    __slots__ = ("scores", "unscored", "reservation", "reservation_skipped")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    UNSCORED_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[PoolScore]
    unscored: _containers.RepeatedCompositeFieldContainer[UnscoredPool]
    reservation: Reservation
    reservation_skipped: str
    def __init__(self, scores: _Optional[_Iterable[_Union[PoolScore, _Mapping]]] = ..., unscored: _Optional[_Iterable[_Union[UnscoredPool, _Mapping]]] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., reservation_skipped: _Optional[str] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "pool", "hit_tokens", "ttl_seconds")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    pool: str
    hit_tokens: int
    ttl_seconds: float
    def __init__(self, reservation_id: _Optional[str] = ..., pool: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ReservationStats(_message.Message):
    __slots__ = ("live", "made", "adopted", "expired", "promised_tokens", "got_tokens", "short_hits")
    LIVE_FIELD_NUMBER: _ClassVar[int]
    MADE_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PROMISED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHORT_HITS_FIELD_NUMBER: _ClassVar[int]
    live: int
    made: int
    adopted: int
    expired: int
    promised_tokens: int
    got_tokens: int
    short_hits: int
    def __init__(self, live: _Optional[int] = ..., made: _Optional[int] = ..., adopted: _Optional[int] = ..., expired: _Optional[int] = ..., promised_tokens: _Optional[int] = ..., got_tokens: _Optional[int] = ..., short_hits: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "client_name", "tenant", "exclusive", "lease_seconds", "expires_in_seconds", "num_requests")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    client_name: str
    tenant: str
    exclusive: bool
    lease_seconds: float
    expires_in_seconds: float
    num_requests: int
    def __init__(self, session_id: _Optional[str] = ..., client_name: _Optional[str] = ..., tenant: _Optional[str] = ..., exclusive: _Optional[bool] = ..., lease_seconds: _Optional[float] = ..., expires_in_seconds: _Optional[float] = ..., num_requests: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "fence")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    fence: Fence
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class AdoptPoolRequest(_message.Message):
    __slots__ = ("pool", "state", "from_replica", "claim_revision")
    POOL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICA_FIELD_NUMBER: _ClassVar[int]
    CLAIM_REVISION_FIELD_NUMBER: _ClassVar[int]
    pool: str
    state: bytes
    from_replica: str
    claim_revision: int
    def __init__(self, pool: _Optional[str] = ..., state: _Optional[bytes] = ..., from_replica: _Optional[str] = ..., claim_revision: _Optional[int] = ...) -> None: ...

class AdoptPoolHeader(_message.Message):
    __slots__ = ("pool", "from_replica", "claim_revision", "state_bytes", "state_sha256", "part_bytes")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICA_FIELD_NUMBER: _ClassVar[int]
    CLAIM_REVISION_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_SHA256_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    from_replica: str
    claim_revision: int
    state_bytes: int
    state_sha256: bytes
    part_bytes: int
    def __init__(self, pool: _Optional[str] = ..., from_replica: _Optional[str] = ..., claim_revision: _Optional[int] = ..., state_bytes: _Optional[int] = ..., state_sha256: _Optional[bytes] = ..., part_bytes: _Optional[int] = ...) -> None: ...

class AdoptPoolPart(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: AdoptPoolHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[AdoptPoolHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AdoptPoolResponse(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class ScoreForTenantRequest(_message.Message):
    __slots__ = ("tenant", "request")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    request: ScorePoolsRequest
    def __init__(self, tenant: _Optional[str] = ..., request: _Optional[_Union[ScorePoolsRequest, _Mapping]] = ...) -> None: ...
