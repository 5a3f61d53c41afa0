"""The values a pool's service is configured with and answers (pool_service.py and its
parts): hash and score settings, limits, scores, inspections, counters, an exclusive
session's mirror state; and :func:`drain`, which runs a sliced piece of work at once.
Plain data, no engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import TypeVar

from kvcoord.engine import CacheHit
from kvcoord.engine.profiles import PROFILES, VLLM_016

from .errors import ServiceError, Status
from .fences import Fence

#: Attach's pool state: the first never-used block, the used free blocks (head first),
#: the prefix-cache map as (hash, block) pairs (engine ``replica_state``)
ReplicaState = tuple[int, list[int], list[tuple[bytes, int]]]

#: (hash_algo, hash_block_size, hash_seed): how a pool's clients hash blocks
HashSettings = tuple[str, int, str]

#: which prompt hashes score a pool (ScorePools): a vllm-0.16 pool's HashSettings, or
#: for a vllm-0.33 pool its HashSettings, "vllm-0.33" and num_hash_lookahead_tokens
#: (0.33 hashes differ from 0.16's as soon as a prompt has a LoRA, a salt, multimodal
#: items or look-ahead tokens: the same three settings must not pick 0.16's hashes)
ScoreSettings = HashSettings | tuple[str, int, str, str, int]


def score_settings(settings: HashSettings, profile: str, num_hash_lookahead_tokens: int) -> ScoreSettings:
    """The settings a prompt hashed by ``profile``'s rules scores (``""``: vllm-0.16).

    Raises:
        ServiceError: INVALID_ARGUMENT for an unknown profile, or look-ahead tokens
            outside vllm-0.33.
    """
    profile = profile or VLLM_016
    if profile not in PROFILES:
        raise ServiceError(Status.INVALID, f"unknown profile {profile[:64]!r} (known: {', '.join(PROFILES)})")
    if profile == VLLM_016:
        if num_hash_lookahead_tokens:
            raise ServiceError(Status.INVALID, "num_hash_lookahead_tokens needs the vllm-0.33 profile")
        return settings
    return (*settings, profile, num_hash_lookahead_tokens)


#: why a pool was not scored (UnscoredPool.reason)
UNSCORED_NO_PROMPT = "NO_PROMPT"
UNSCORED_TOO_LONG = "TOO_LONG"


@dataclasses.dataclass(frozen=True, slots=True)
class PoolScore:
    """One pool's answer to a router: the hit a request would get now, and room left."""

    pool: str
    hit: CacheHit
    num_free_blocks: int
    usage: float
    num_total_blocks: int
    fence: Fence

    def rank(self) -> tuple[int, int, str]:
        """Sort key, best first: longest hit, then most free blocks, then name."""
        return (-self.hit.num_tokens, -self.num_free_blocks, self.pool)


_set_pool, _set_hit, _set_free, _set_usage, _set_total, _set_fence = (
    vars(PoolScore)[f.name].__set__ for f in dataclasses.fields(PoolScore)
)


def new_score(
    pool: str, hit: CacheHit, num_free_blocks: int, usage: float, num_total_blocks: int, fence: Fence
) -> PoolScore:
    """``PoolScore(...)`` without the frozen dataclass's ``__init__`` (one per pool per
    ScorePools call): the slots written through their member descriptors, as the
    generated ``__init__`` does, at a fraction of the cost (as ``engine.results.new_hit``)."""
    score: PoolScore = object.__new__(PoolScore)
    _set_pool(score, pool)
    _set_hit(score, hit)
    _set_free(score, num_free_blocks)
    _set_usage(score, usage)
    _set_total(score, num_total_blocks)
    _set_fence(score, fence)
    return score


@dataclasses.dataclass(frozen=True, slots=True)
class ReservationLease:
    """Who holds a live reservation of this pool, and until when (monotonic)."""

    tenant: str
    deadline: float


@dataclasses.dataclass(frozen=True, slots=True)
class UnscoredPool:
    """A pool that cannot serve the prompt as sent (``reason``: UNSCORED_*)."""

    pool: str
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class RequestView:
    """One request as InspectPool shows it."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    num_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Inspection:
    """A pool's state for an operator (:meth:`PoolService.inspect`)."""

    num_free_blocks: int
    usage: float
    free_queue_head: list[int]
    requests: list[RequestView]
    cached_block_ids: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolCounters:
    """A pool's lifetime counters and gauges (the /metrics scrape)."""

    usage: float
    num_free_blocks: int
    num_requests: int
    lookups: int
    queries: int
    hits: int
    short_lookups: int
    group_hit_tokens: tuple[int, ...]
    evictions: int
    refusals: int
    allocated: int
    freed: int


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Server limits; exceeding one is RESOURCE_EXHAUSTED."""

    max_pools: int = 64
    max_blocks_per_pool: int = 50_000_000
    max_requests_per_pool: int = 1_000_000
    max_ops_per_step: int = 65_536
    event_buffer: int = 65_536
    #: the longest request a pool admits; a pool's max_model_len 0 means this
    max_tokens_per_request: int = 1 << 20
    #: budget for the estimated memory of every pool together (budget.py)
    max_pool_memory_bytes: int = 8 << 30
    #: live sessions per tenant (a tenant's max_sessions overrides it)
    max_sessions_per_tenant: int = 10_000
    #: live ScorePools reservations per tenant (every pool this server serves: a
    #: cluster's replica counts its own), and their longest life
    max_reservations_per_tenant: int = 256
    max_reservation_seconds: float = 30.0


Undo = Callable[[], None]


@dataclasses.dataclass(frozen=True, slots=True)
class MirrorState:
    """An exclusive session's pool state (AttachResponse.pool_state with
    want_engine_state): :func:`export_state`'s value as CBOR, its version, the engine's
    rules fingerprint and the session's cache namespace."""

    engine_state: bytes
    version: int
    rules: str
    cache_namespace: str


T = TypeVar("T")


def drain(work: Generator[None, None, T]) -> T:
    """Run a sliced piece of work (:meth:`PoolService.applying`) to its end at once."""
    while True:
        try:
            next(work)
        except StopIteration as done:
            value: T = done.value
            return value
