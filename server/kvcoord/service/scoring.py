"""ScorePools: a router's question to the authority, answered for many pools at once.

A router holds a prompt and a set of pools (or none: every pool it may observe) and
asks which pool would reuse most of the prompt's KV cache. Each pool answers with
:meth:`PoolService.score`, which is that pool's own read-only
``find_longest_cache_hit`` for the caller's tenant: the hit a request of that prompt
would get there now, by the pool's own coordinator. Nothing in any pool changes.

Plain Python: the servicer converts messages to these calls and back.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from typing import Any

from kvcoord.engine.block_pool import BlockHashToBlockMap
from kvcoord.engine.hash_list import SharedHashes, hashes_at_block_size
from kvcoord.engine.results import CacheHit

from .errors import ServiceError, Status
from .pool_service import PoolScore, PoolService, ScoreSettings, UnscoredPool

__all__ = ["Reserve", "ReservationMade", "ScoreIndex", "Scores", "score_pools"]


@dataclasses.dataclass(frozen=True, slots=True)
class Reserve:
    """Hold the best pool's hit for ``seconds`` (score and reserve).

    Args:
        seconds: the reservation's time to live.
        may_use: whether the caller holds the use role on a pool.
        max_seconds: the longest time to live allowed.
        max_per_tenant: live reservations a tenant may hold over every pool of
            ``pools`` (the pools this server serves: in a cluster, this replica's).
        may_change: raises when the pool may not be changed here now, as for any
            mutating call of it (a cluster's placement check: a pool being handed
            over, whose state was sent to its next owner, is OWNER_CHANGING).
    """

    seconds: float
    may_use: Callable[[str], bool]
    max_seconds: float
    max_per_tenant: int
    may_change: Callable[[str], None] = lambda _pool: None


@dataclasses.dataclass(frozen=True, slots=True)
class ReservationMade:
    """A reservation made, with what the journal needs to make it again."""

    reservation_id: str
    pool: str
    hit_tokens: int
    seconds: float
    hashes: Sequence[bytes]
    num_tokens: int
    tenant: str


@dataclasses.dataclass(frozen=True, slots=True)
class Scores:
    """Every scored pool, best first (:meth:`PoolScore.rank`), and the pools that
    could not be scored, in name order."""

    scores: tuple[PoolScore, ...]
    unscored: tuple[UnscoredPool, ...]
    reservation: ReservationMade | None = None
    #: why no reservation was made, when one was asked for
    reservation_skipped: str = ""


def score_pools(
    pools: Mapping[str, PoolService],
    may_observe: Callable[[str], bool],
    candidates: Sequence[str],
    num_tokens: int,
    prompts: Sequence[tuple[ScoreSettings, Sequence[bytes]]],
    tenant: str = "",
    reserve: Reserve | None = None,
    index: ScoreIndex | None = None,
) -> Scores:
    """Score a prompt in each candidate pool (every observable pool without candidates).

    Args:
        pools: the server's pools by name.
        may_observe: whether the caller holds the observe role on a pool.
        candidates: pool names; empty = every pool ``may_observe`` accepts.
        num_tokens: the prompt's length in tokens (>= 1).
        prompts: the prompt's block hashes per hash settings (at most one each): a
            vllm-0.16 pool is scored with the prompt of its hash settings, a vllm-0.33
            pool with the one of its settings, profile and look-ahead
            (:attr:`PoolService.score_settings`).
        tenant: the caller's tenant (whose prefix-cache namespace is searched).
        reserve: also hold the best pool's hit (``None``: score only).
        index: the server's cross-pool index: hit lengths alone (the scores' hits carry
            no block ids) found by one walk per prompt view for every pool it covers;
            ``None``: each pool's own search, block ids included. Not used with
            ``reserve`` (the reserved pool's hit needs its block ids).

    Raises:
        ServiceError: INVALID_ARGUMENT (num_tokens < 1, a pool named twice, two
            prompts with the same settings, hashes a pool refuses), PERMISSION_DENIED
            (a candidate the caller may not observe, known or not), NOT_FOUND (an
            unknown candidate the caller could observe). With ``reserve``: INVALID_ARGUMENT
            (seconds not in ``(0, max_seconds]``), PERMISSION_DENIED (no use role on
            the best pool), RESOURCE_EXHAUSTED (the tenant's reservations are at their
            limit), FAILED_PRECONDITION (the best pool has an exclusive session).
    """
    if type(num_tokens) is not int or num_tokens < 1:
        raise ServiceError(Status.INVALID, f"num_tokens must be >= 1, got {num_tokens!r}")
    if reserve is not None and not (
        0 < reserve.seconds <= reserve.max_seconds and math.isfinite(reserve.seconds)
    ):
        raise ServiceError(
            Status.INVALID,
            f"reserve_seconds must be > 0 and at most {reserve.max_seconds}, got {reserve.seconds!r}",
        )
    by_settings: dict[ScoreSettings, Sequence[bytes]] = {}
    for settings, hashes in prompts:
        if settings in by_settings:
            raise ServiceError(
                Status.INVALID,
                f"two prompts hashed with the same settings {settings!r}: send each settings once",
            )
        # one copy per prompt that every pool reads (its checks and derived keys shared)
        by_settings[settings] = SharedHashes(hashes)
    if candidates:
        if len(set(candidates)) != len(candidates):
            twice = sorted({c for c in candidates if candidates.count(c) > 1})
            raise ServiceError(Status.INVALID, f"candidate_pools names {twice[0][:128]!r} more than once")
        for name in candidates:
            if not may_observe(name):
                raise ServiceError(
                    Status.DENIED,
                    f"the caller lacks the observe role on pool {name[:128]!r} (ScorePools needs it)",
                )
            if name not in pools:
                raise ServiceError(
                    Status.NOT_FOUND,
                    f"pool {name[:200]!r} does not exist (ListPools shows the pools you may use)",
                )
        names: Sequence[str] = candidates
    else:
        names = [n for n in sorted(pools) if may_observe(n)]
    scored: list[PoolScore] = []
    unscored: list[UnscoredPool] = []
    if index is not None and reserve is None:
        index.score(pools, names, num_tokens, by_settings, tenant, scored, unscored)
    else:
        for name in names:
            answer = pools[name].score(by_settings, num_tokens, tenant)
            if isinstance(answer, PoolScore):
                scored.append(answer)
            else:
                unscored.append(answer)
    scored.sort(key=PoolScore.rank)
    unscored.sort(key=lambda u: u.pool)
    if reserve is None:
        return Scores(tuple(scored), tuple(unscored))
    if not scored or not scored[0].hit.num_tokens:
        why = "no pool was scored" if not scored else f"the best pool {scored[0].pool!r} has no hit"
        return Scores(tuple(scored), tuple(unscored), reservation_skipped=why)
    return Scores(
        tuple(scored), tuple(unscored), _reserve(pools, scored[0], by_settings, num_tokens, tenant, reserve)
    )


def _reserve(
    pools: Mapping[str, PoolService],
    best: PoolScore,
    by_settings: Mapping[ScoreSettings, Sequence[bytes]],
    num_tokens: int,
    tenant: str,
    reserve: Reserve,
) -> ReservationMade:
    if not reserve.may_use(best.pool):
        raise ServiceError(
            Status.DENIED,
            f"the caller lacks the use role on pool {best.pool!r} (reserving a hit there needs it)",
        )
    held = sum(p.reservations_of(tenant) for p in pools.values())
    if held >= reserve.max_per_tenant:
        raise ServiceError(
            Status.EXHAUSTED,
            f"the caller's tenant already holds {held} live reservations (max_reservations_per_tenant "
            f"{reserve.max_per_tenant}); let them be adopted or expire",
        )
    # a reservation changes the pool (blocks held, a journal record): only where any
    # mutating call of it would be applied (was: in a pool being handed over too, after
    # its state was sent, so the next owner never had the reservation it answered)
    reserve.may_change(best.pool)
    service = pools[best.pool]
    hashes = list(by_settings.get(service.score_settings, ()))
    reservation_id = secrets.token_hex(8)
    hit = service.reserve(reservation_id, hashes, num_tokens, tenant, reserve.seconds)
    assert hit == best.hit, "the pool changed between its score and its reservation"
    return ReservationMade(
        reservation_id, best.pool, hit.num_tokens, reserve.seconds, hashes, num_tokens, tenant
    )


class _Watch:
    """One pool's part of a :class:`ScoreIndex`: its bit, and the map whose keys in the
    group the search starts with (full attention) the bit marks. It is that map's
    :class:`~kvcoord.engine.block_pool.KeyHook`, so every key entering or leaving the
    group's ``first`` dict sets or clears the bit as it happens."""

    __slots__ = ("bit", "first", "gid", "hash_block_size", "how", "map", "masks", "size")

    def __init__(
        self, masks: dict[bytes, int], bit: int, target: tuple[BlockHashToBlockMap, int, int, int, str]
    ) -> None:
        self.masks = masks
        self.bit = bit
        self.map, self.gid, self.size, self.hash_block_size, self.how = target
        self.first = self.map.first[self.gid]

    def added(self, block_hash: bytes) -> None:
        masks = self.masks
        masks[block_hash] = masks.get(block_hash, 0) | self.bit

    def removed(self, block_hash: bytes) -> None:
        masks = self.masks
        left = masks.get(block_hash, 0) & ~self.bit
        if left:
            masks[block_hash] = left
        else:
            masks.pop(block_hash, None)

    def current(self, live: BlockHashToBlockMap) -> bool:
        """Whether the bits still follow the pool's live map: the same map (a new
        engine, from a journal replay, a state restore or an adoption, has a new one; a
        reset makes one), with the same dict, and this watch still its hook."""
        return live is self.map and live.hook is self and live.first[self.gid] is self.first


class ScoreIndex:
    """Which pools cache each key: one bit per pool, over every pool's keys of the
    group its search starts with (when that is full attention).

    The bits of a pool are exactly the keys of that group's ``first`` dict: the pool's
    map tells its watch of every key entering or leaving it (the engine's own write
    paths: caching, eviction, :meth:`BlockHashToBlockMap.pop`), and anything that
    replaces the map, the dict or the engine (a prefix-cache reset, a state restore,
    a journal replay into a new engine, a cluster adoption, a delete and re-create)
    leaves the watch stale: the next score drops its bits (they are the old dict's keys,
    which nothing changes any more) and marks the live dict's keys again. A pool is
    watched from the first time it is scored without block ids; its Steps pay one call
    per key that enters or leaves its map from then on.

    Scoring reads each prompt view's keys once for every watched pool that searches
    that view (one dictionary lookup per block instead of one per block per pool):
    a pool of one full-attention group gets its hit length from the walk alone (the
    run of cached keys from the first, at most ``(num_tokens - 1) // block_size``,
    one block less with EAGLE); any other watched pool whose run is empty has no hit
    (the coordinator's first search is that group's, and caps every other), and one
    whose run is not empty is searched by its own coordinator.
    """

    def __init__(self) -> None:
        #: key -> bits of the pools whose watched group caches it
        self.masks: dict[bytes, int] = {}
        self._watches: dict[str, _Watch] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        #: length-only hits, one per length (frozen, shared: fewer objects per call)
        self._hits: dict[int, CacheHit] = {}

    def watch(self, name: str, service: PoolService) -> _Watch | None:
        """The pool's current watch, made or remade as needed; ``None`` when the pool's
        search does not start with full attention (or caching is off)."""
        w = self._watches.get(name)
        if w is not None:
            if w.current(service.score_map()):
                return w
            self.forget(name)
        target = service.score_target()
        if target is None or target[0].hook is not None:
            return None
        bit = self._free_bits.pop() if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit <<= 1
        w = _Watch(self.masks, bit, target)
        masks = self.masks
        for key in w.first:
            masks[key] = masks.get(key, 0) | bit
        w.map.hook = w
        self._watches[name] = w
        return w

    def forget(self, name: str) -> None:
        """Stop watching ``name`` (deleted, or its map replaced): its bits cleared."""
        w = self._watches.pop(name, None)
        if w is None:
            return
        if w.map.hook is w:
            w.map.hook = None
        remove = w.removed
        for key in w.first:
            remove(key)
        self._free_bits.append(w.bit)

    def keys_of(self, name: str) -> set[bytes]:
        """The keys whose mask holds ``name``'s bit (tests compare them with the map)."""
        w = self._watches.get(name)
        if w is None:
            return set()
        return {k for k, m in self.masks.items() if m & w.bit}

    def score(
        self,
        pools: Mapping[str, PoolService],
        names: Sequence[str],
        num_tokens: int,
        prompts: Mapping[ScoreSettings, Sequence[bytes]],
        tenant: str,
        scored: list[PoolScore],
        unscored: list[UnscoredPool],
    ) -> None:
        """Score ``names`` (already checked) into ``scored`` and ``unscored``."""
        # (view, max blocks) -> [view, bits of its pools, its pools]
        walks: dict[tuple[int, int], list[Any]] = {}
        for name in names:
            service = pools[name]
            w = self.watch(name, service)
            keys = None if w is None else service.score_keys(prompts, num_tokens, tenant)
            if keys is None:  # not watched, or not scored (the pool says why)
                answer = service.score(prompts, num_tokens, tenant)
                (scored if isinstance(answer, PoolScore) else unscored).append(answer)  # type: ignore[arg-type]
                continue
            assert w is not None
            view = hashes_at_block_size(keys, w.hash_block_size, w.size)
            limit = min((num_tokens - 1) // w.size, len(view))
            walk = walks.get((id(view), limit))
            if walk is None:
                walk = walks[(id(view), limit)] = [view, 0, []]
            walk[1] |= w.bit
            walk[2].append((w, service, keys))
        get = self.masks.get
        hits = self._hits
        for (_, limit), (view, live, members) in walks.items():
            # (bits that stopped, at that block) in order; the rest run to ``limit``
            stops: list[tuple[int, int]] = []
            i = 0
            for key in islice(view, limit):
                held = get(key, 0)
                gone = live & ~held
                if gone:
                    stops.append((gone, i))
                    live &= held
                    if not live:
                        break
                i += 1
            for w, service, keys in members:
                bit = w.bit
                n = limit
                for gone, at in stops:
                    if gone & bit:
                        n = at
                        break
                how = w.how
                if how == "unitary" or not n:
                    tokens = n * w.size  # (no run: the first search finds nothing, nor any other)
                elif how == "eagle":
                    tokens = (n - 1) * w.size
                elif how == "run":  # the other groups searched, the first group's is this run
                    tokens = service.hit_length_from_run(keys, num_tokens, n)
                else:  # the coordinator's own search, bounded above by this run
                    scored.append(service.score(prompts, num_tokens, tenant))
                    continue
                hit = hits.get(tokens)
                if hit is None:
                    # no block ids: reading them fails loudly (None is no sequence)
                    hit = hits[tokens] = CacheHit(None, tokens)  # type: ignore[arg-type]
                scored.append(service.score_of_length(hit))
