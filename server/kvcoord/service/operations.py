"""Pool operations and their results as plain values (what a Step carries).

The servicer converts wire messages into these (``convert.py``); the pool service
(``pool_service.py``) applies them. Sequences may be any sequence type, so a wire
container can be passed through without copying. They are values: nothing changes one
after it is built. They are not ``frozen`` dataclasses only because a frozen one costs
five times as much to build, and a Step builds a few per operation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvcoord.engine import CacheHit, KVCacheEvent, LoRA, PrefixCacheStats
from kvcoord.engine.decode_run import DecodeColumns
from kvcoord.engine.extra_keys import ExtraKeySources

from .errors import ServiceError

__all__ = [
    "Admit",
    "Admitted",
    "Allocate",
    "AllocateOutcome",
    "CacheBlocks",
    "CommonPrefix",
    "Decode",
    "DecodeFailed",
    "DecodeOutcome",
    "EventsTaken",
    "EvictBlocks",
    "Free",
    "GetBlockIds",
    "Lookup",
    "MakeStats",
    "Operation",
    "Outcome",
    "Preempt",
    "RemoveSkipped",
    "RequestSync",
    "ResetPrefixCache",
    "Sync",
    "TakeEvents",
    "RecordStats",
    "EstimateCachedTokens",
    "NewStepStarts",
    "TakeBlockCopies",
    "ReleaseRetained",
    "DropOffloads",
    "RecordForZeroing",
    "DropUncomputed",
    "TakeBoundaryStateOffloads",
    "TakeNewBlockIds",
    "GetNumBlocksToAllocate",
]

BlockIds = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(slots=True)
class RequestSync:
    """A positioned change to one request (see the proto's RequestSync)."""

    request_id: str
    append_token_ids: Sequence[int] = ()
    append_block_hashes: Sequence[bytes] = ()
    new_request: bool = False
    base_num_tokens: int = 0
    base_num_hashes: int = 0
    num_computed_tokens: int | None = None
    lora: LoRA | None = None
    skip_reading_prefix_cache: bool = False
    num_preemptions: int | None = None
    cache_salt: str | None = None
    extra_key_sources: ExtraKeySources | None = None
    num_prompt_tokens: int | None = None
    kv_cache_report_full: bool = False
    #: a registered request's rewind (vLLM 0.33's streaming-input cut): its tokens past
    #: this many dropped, and its hashes from this many // hash_block_size on, before
    #: the append (``None``: no rewind; see the proto's RequestSync)
    rewind_num_tokens: int | None = None


@dataclasses.dataclass(slots=True)
class Lookup:
    """get_computed_blocks; ``hint`` answers with the eviction margin and records
    nothing; ``answered`` is the hit the client already answered with (checked)."""

    sync: RequestSync
    hint: bool = False
    walk_limit: int = 0
    answered: CacheHit | None = None


@dataclasses.dataclass(slots=True)
class LookedUp:
    """A vllm-0.33 pool's lookup: the hit and the request's shared-prefix boundary."""

    hit: CacheHit
    shared_prefix_boundary: int


@dataclasses.dataclass(slots=True)
class Hinted:
    """A hint lookup's value: the hit and its eviction margin."""

    hit: CacheHit
    eviction_margin: int


@dataclasses.dataclass(slots=True)
class Allocate:
    sync: RequestSync
    num_new_tokens: int
    num_new_computed_tokens: int = 0
    new_computed_blocks: CacheHit | None = None
    num_lookahead_tokens: int = 0
    num_external_computed_tokens: int = 0
    delay_cache_blocks: bool = False
    num_encoder_tokens: int = 0
    lookup: bool = False
    must_succeed: bool = False
    must_refuse: bool = False
    return_table: bool = False
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    num_in_flight_tokens: int = 0
    watermark_blocks: int = 0
    skip_zeroing_group_ids: tuple[int, ...] = ()
    #: every field after ``num_new_tokens`` is at its default and the sync is of a
    #: registered request (a decode step's allocation): the pool may apply it on its
    #: direct path (PoolAllocations.allocate_plain), which answers exactly as the general
    #: one. Set only by whoever checked that (the wire reader); False is always right.
    plain: bool = dataclasses.field(default=False, compare=False)


#: the columns AllocateRun and Decode share: the engine's own value (one definition)
RunColumns = DecodeColumns


@dataclasses.dataclass(slots=True)
class AllocateRun(RunColumns):
    """Promised decode allocations in columns (see the proto's AllocateRunOp)."""

    #: allocations the client answered as changing nothing, checked in order
    checks: RunChecks | None = None


@dataclasses.dataclass(slots=True)
class Decode(RunColumns):
    """A decode step's allocations in columns, each applied as its AllocateOp would be
    (see the proto's DecodeOp)."""

    must_succeed: bool = False


@dataclasses.dataclass(slots=True)
class DecodeOutcome:
    """A Decode's answer: the entries applied, their new blocks (counts per entry and
    group, then the ids) and the indices of the refused ones."""

    num_applied: int
    num_new_blocks: list[int]
    new_block_ids: list[int]
    refused: list[int]


class DecodeFailed(ServiceError):
    """Entry ``partial.num_applied`` of a Decode failed with this (its AllocateOp's own)
    error; the entries before it, in ``partial``, stay applied."""

    def __init__(self, err: ServiceError, partial: DecodeOutcome) -> None:
        super().__init__(err.status, err.message, err.reason, err.position, err.owner)
        self.partial = partial


@dataclasses.dataclass(slots=True)
class RunChecks:
    """An AllocateRun's checks (see the proto's AllocateRunOp ``check_*``): check j
    comes before entry ``at[j]``."""

    request_ids: Sequence[str]
    at: Sequence[int]
    num_computed_tokens: Sequence[int]
    num_new_tokens: Sequence[int]
    num_lookahead_tokens: Sequence[int]
    num_tokens: Sequence[int]


@dataclasses.dataclass(slots=True)
class RunOutcome:
    """An AllocateRun's new blocks: counts per entry and group, then the ids."""

    num_new_blocks: list[int]
    new_block_ids: list[int]


@dataclasses.dataclass(slots=True)
class Free:
    request_id: str
    #: free it only if this session holds it: a request unknown, or another
    #: session's, is not an error (a free sent again)
    if_held: bool = False
    #: vLLM 0.33's deferred-free order: all groups concatenated, one reversed pass
    all_groups_reversed: bool = False
    #: an undone step's free: the cache entries of the request's blocks holding any
    #: position at or past this token are dropped first (their KV was never written)
    uncomputed_from: int | None = None


@dataclasses.dataclass(slots=True)
class Preempt:
    request_id: str


@dataclasses.dataclass(slots=True)
class CacheBlocks:
    sync: RequestSync
    num_computed_tokens: int


@dataclasses.dataclass(slots=True)
class RemoveSkipped:
    sync: RequestSync
    total_computed_tokens: int


@dataclasses.dataclass(slots=True)
class EvictBlocks:
    block_ids: Sequence[int]


@dataclasses.dataclass(slots=True)
class GetBlockIds:
    request_id: str
    #: the table the client already answered with (checked), or None for a plain read
    answered: tuple[tuple[int, ...], ...] | None = None
    #: vLLM 0.33's get_block_ids_for_computed_tokens: clip to this many tokens
    computed_tokens: int | None = None


@dataclasses.dataclass(slots=True)
class CommonPrefix:
    request_id: str


@dataclasses.dataclass(slots=True)
class ResetPrefixCache:
    pass


@dataclasses.dataclass(slots=True)
class TakeEvents:
    pass


@dataclasses.dataclass(slots=True)
class MakeStats:
    peek: bool = False


@dataclasses.dataclass(slots=True)
class Sync:
    sync: RequestSync


@dataclasses.dataclass(slots=True)
class RecordStats:
    """vLLM 0.33's record_prefix_cache_stats (vllm-0.33 pools)."""

    request_id: str
    num_hits: int


@dataclasses.dataclass(slots=True)
class EstimateCachedTokens:
    request_id: str


@dataclasses.dataclass(slots=True)
class NewStepStarts:
    pass


@dataclasses.dataclass(slots=True)
class TakeNewBlockIds:
    """vLLM 0.33's take_new_block_ids (vllm-0.33 pools)."""


@dataclasses.dataclass(slots=True)
class TakeBoundaryStateOffloads:
    """vLLM 0.33's take_boundary_state_offloads (vllm-0.33 pools)."""


@dataclasses.dataclass(slots=True)
class TakeBlockCopies:
    """vLLM 0.33's take_kv_cache_block_copies (vllm-0.33 pools)."""


@dataclasses.dataclass(slots=True)
class ReleaseRetained:
    """vLLM 0.33's release of the copies' retained blocks, in order (vllm-0.33 pools)."""

    block_ids: Sequence[int]


@dataclasses.dataclass(slots=True)
class DropOffloads:
    """The request's pending boundary-state hand-offs dropped, as vLLM 0.33's
    pop_blocks_for_free does (vllm-0.33 pools)."""

    request_id: str


@dataclasses.dataclass(slots=True)
class RecordForZeroing:
    """The request's blocks from start_token on recorded again for zeroing, as vLLM
    0.33's record_blocks_for_zeroing (vllm-0.33 pools)."""

    request_id: str
    start_token: int


@dataclasses.dataclass(slots=True)
class DropUncomputed:
    """An undone step's deferred free, at the take: the cache entries of the request's
    blocks holding any position at or past uncomputed_from dropped, the blocks kept."""

    request_id: str
    uncomputed_from: int


@dataclasses.dataclass(slots=True)
class GetNumBlocksToAllocate:
    request_id: str
    num_tokens: int
    total_computed_tokens: int
    num_tokens_main_model: int
    apply_admission_cap: bool = False
    num_encoder_tokens: int = 0


@dataclasses.dataclass(slots=True)
class Admit:
    """Admit waiting requests in order (see the proto's AdmitOp)."""

    syncs: Sequence[RequestSync]
    token_budget: int
    num_lookahead_tokens: int = 0


Operation = (
    Lookup
    | Allocate
    | Free
    | Preempt
    | CacheBlocks
    | RemoveSkipped
    | EvictBlocks
    | GetBlockIds
    | CommonPrefix
    | ResetPrefixCache
    | TakeEvents
    | MakeStats
    | Sync
    | Admit
    | AllocateRun
    | Decode
    | RecordStats
    | EstimateCachedTokens
    | NewStepStarts
    | GetNumBlocksToAllocate
    | TakeNewBlockIds
    | TakeBoundaryStateOffloads
    | TakeBlockCopies
    | ReleaseRetained
    | DropOffloads
    | RecordForZeroing
    | DropUncomputed
)


@dataclasses.dataclass(slots=True)
class AllocateOutcome:
    """allocate_slots' answer: ``new_block_ids`` is None when refused or stale."""

    new_block_ids: BlockIds | None
    num_new_tokens: int
    hit: CacheHit | None = None
    stale_hit: bool = False
    #: with Allocate.return_table: the request's whole table after the allocation
    table: BlockIds | None = None

    @property
    def refused(self) -> bool:
        return self.new_block_ids is None and not self.stale_hit


@dataclasses.dataclass(slots=True)
class Admitted:
    """One outcome per request processed by an Admit, in order."""

    outcomes: list[AllocateOutcome]


@dataclasses.dataclass(slots=True)
class EventsTaken:
    events: list[KVCacheEvent]
    gap: bool
    #: cut at a byte budget: more events wait after the session's cursor
    more: bool = False


#: What one operation produced: a value (None for operations without one), or the
#: error that stopped it.
Value = (
    CacheHit
    | LookedUp
    | Hinted
    | RunOutcome
    | DecodeOutcome
    | AllocateOutcome
    | Admitted
    | BlockIds
    | tuple[int, ...]
    | bool
    | int
    | EventsTaken
    | PrefixCacheStats
    | list[int]
    | dict[str, list[tuple[int, int, int]]]
    | tuple[list[tuple[int, int]], list[int]]
    | None
)


@dataclasses.dataclass(slots=True)
class Outcome:
    value: Value = None
    error: ServiceError | None = None
    #: True when not applied because an earlier operation of the Step failed
    aborted_by: int | None = None
