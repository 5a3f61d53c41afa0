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

from ..engine.hash_list import SharedHashes
from .errors import ServiceError, Status
from .pool_service import HashSettings, PoolScore, PoolService, UnscoredPool

__all__ = ["Reserve", "ReservationMade", "Scores", "score_pools"]


@dataclasses.dataclass(frozen=True, slots=True)
class Reserve:
    """Hold the best pool's hit for ``seconds`` (score and reserve).

    Args:
        seconds: the reservation's time to live.
        may_use: whether the caller holds the use role on a pool.
        max_seconds: the longest time to live allowed.
        max_per_tenant: live reservations a tenant may hold over every pool.
    """

    seconds: float
    may_use: Callable[[str], bool]
    max_seconds: float
    max_per_tenant: int


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
    prompts: Sequence[tuple[HashSettings, Sequence[bytes]]],
    tenant: str = "",
    reserve: Reserve | None = None,
) -> Scores:
    """Score a prompt in each candidate pool (every observable pool without candidates).

    Args:
        pools: the server's pools by name.
        may_observe: whether the caller holds the observe role on a pool.
        candidates: pool names; empty = every pool ``may_observe`` accepts.
        num_tokens: the prompt's length in tokens (>= 1).
        prompts: the prompt's block hashes per hash settings (at most one each).
        tenant: the caller's tenant (whose prefix-cache namespace is searched).
        reserve: also hold the best pool's hit (``None``: score only).

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
    by_settings: dict[HashSettings, Sequence[bytes]] = {}
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
    by_settings: Mapping[HashSettings, Sequence[bytes]],
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
    service = pools[best.pool]
    hashes = list(by_settings.get(service.hash_settings, ()))
    reservation_id = secrets.token_hex(8)
    hit = service.reserve(reservation_id, hashes, num_tokens, tenant, reserve.seconds)
    assert hit == best.hit, "the pool changed between its score and its reservation"
    return ReservationMade(
        reservation_id, best.pool, hit.num_tokens, reserve.seconds, hashes, num_tokens, tenant
    )
