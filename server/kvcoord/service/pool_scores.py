"""A pool's answers to routers (ScorePools, scoring.py): the hit a prompt would get
now and the room left, and what a cross-pool score index reads to find hit lengths
without the pool's own search. Reads only. A part of :class:`~.pool_service.PoolService`
(its ``scoring``), reached through it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcoord.engine import CacheHit, EngineError
from kvcoord.engine.block_pool import BlockHashToBlockMap
from kvcoord.engine.profiles import VLLM_016

from .errors import ServiceError, Status
from .pool_core import PoolCore
from .pool_types import (
    UNSCORED_NO_PROMPT,
    UNSCORED_TOO_LONG,
    PoolScore,
    ScoreSettings,
    UnscoredPool,
    new_score,
)


class PoolScoring:
    """Scores of one pool (:class:`~.pool_service.PoolService` forwards to these)."""

    def __init__(self, pool: PoolCore) -> None:
        self.pool = pool

    def score(
        self, prompts: Mapping[ScoreSettings, Sequence[bytes]], num_tokens: int, tenant: str = ""
    ) -> PoolScore | UnscoredPool:
        """This pool's score for a prompt of ``num_tokens`` tokens hashed once per hash
        settings: the hit :meth:`find_longest_cache_hit` answers for ``tenant`` (the
        same engine call: read-only), or why the pool cannot be scored.

        Raises:
            ServiceError: INVALID_ARGUMENT naming the pool when the prompt with its
                settings has the wrong hashes (count, type, length).
        """
        engine = self.pool.engine
        if num_tokens > engine.max_model_len:
            return UnscoredPool(
                self.pool.name,
                UNSCORED_TOO_LONG,
                f"the prompt's {num_tokens} tokens exceed the pool's max_model_len {engine.max_model_len}",
            )
        if self.pool.config.enable_caching:
            hashes = prompts.get(self.pool.score_settings)
            if hashes is None:
                algo, size, seed = self.pool.hash_settings
                return UnscoredPool(
                    self.pool.name,
                    UNSCORED_NO_PROMPT,
                    f"no prompt hashed with the pool's settings (hash_algo {algo!r}, hash_block_size "
                    f"{size}, hash_seed {seed!r}, profile {self.pool.config.profile!r}"
                    + (
                        f", num_hash_lookahead_tokens {self.pool.config.num_hash_lookahead_tokens})"
                        if self.pool.config.num_hash_lookahead_tokens
                        else ")"
                    ),
                )
        else:
            hashes = ()  # nothing is ever cached: the hit is empty whatever the hashes
        try:
            # the engine's own call, one layer less than find_longest_cache_hit above
            hit = engine.find_longest_cache_hit(
                hashes, num_tokens, self.pool.cache_namespace(tenant) if tenant else ""
            )
        except EngineError as exc:
            raise ServiceError(Status.INVALID, f"pool {self.pool.name!r}: {exc}") from None
        free, usage = engine.free_and_usage()
        return new_score(self.pool.name, hit, free, usage, self.pool.config.num_blocks - 1, self.pool.fence)

    # -- what ScoreIndex (scoring.py) reads: hit lengths without this pool's own search
    def score_target(self) -> tuple[BlockHashToBlockMap, int, int, int, str] | None:
        """What a cross-pool score index watches here: the prefix-cache map (a new
        engine has a new one), the id and block size of the full-attention group the
        search starts with, the hash block size, and how a hit follows from that
        group's run of cached keys ("unitary", "eagle": one group; "run": a hybrid whose
        first attention group is that group alone; "search": the coordinator's own
        search). ``None`` when caching is off or the search starts otherwise.

        A vllm-0.33 pool of one group has the same search as a 0.16 one (the run of
        cached keys, at most ``(num_tokens - 1) // block_size`` blocks and one per hash
        it has: look-ahead hashes are fewer; 0.33 refuses EAGLE's drop). A vllm-0.33
        hybrid is "search": its hit is cut back on every full-attention group, so an
        empty run of the first one means no hit, and any other run is its own
        coordinator's search (sparse retention, scheduler-block alignment and
        shared-prefix junctions are rules the run alone does not follow)."""
        engine = self.pool.engine
        cfg = engine.config
        first = engine.hits.first_full
        if first is None or not cfg.enable_caching or (cfg.profile != VLLM_016 and cfg.use_eagle):
            return None
        if cfg.coordinator_kind == "unitary":
            how = "eagle" if cfg.use_eagle else "unitary"
        elif cfg.profile != VLLM_016:
            how = "search"
        else:
            how = "run" if len(engine.coordinator.attention_groups[0][1]) == 1 else "search"  # type: ignore[attr-defined]
        return engine.block_pool.cached_block_hash_to_block, first[0], first[1], cfg.hash_block_size, how

    def score_map(self) -> BlockHashToBlockMap:
        return self.pool.engine.block_pool.cached_block_hash_to_block

    def score_keys(
        self, prompts: Mapping[ScoreSettings, Sequence[bytes]], num_tokens: int, tenant: str
    ) -> Sequence[bytes] | None:
        """The keys :meth:`score` searches for, after its checks; ``None`` when
        :meth:`score` answers an :class:`UnscoredPool` (or caching is off).

        Raises:
            ServiceError: as :meth:`score`.
        """
        engine = self.pool.engine
        hashes = prompts.get(self.pool.score_settings)
        if num_tokens > engine.max_model_len or hashes is None:
            return None
        try:
            return engine.hits.lookup_keys(
                hashes, num_tokens, self.pool.cache_namespace(tenant) if tenant else ""
            )
        except EngineError as exc:
            raise ServiceError(Status.INVALID, f"pool {self.pool.name!r}: {exc}") from None

    def score_of_length(self, hit: CacheHit) -> PoolScore:
        """This pool's score with ``hit`` (found by a score index)."""
        free, usage = self.pool.engine.free_and_usage()
        return new_score(self.pool.name, hit, free, usage, self.pool.config.num_blocks - 1, self.pool.fence)

    def hit_length_from_run(self, keys: Sequence[bytes], num_tokens: int, run: int) -> int:
        """The hit length of a "run" pool (:meth:`score_target`) given its first group's run."""
        return int(self.pool.engine.coordinator.hit_length_from_run(keys, num_tokens - 1, run))  # type: ignore[attr-defined]
