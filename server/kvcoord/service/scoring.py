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
from collections.abc import Callable, Mapping, Sequence

import grpc

from .errors import ServiceError
from .pool_service import HashSettings, PoolScore, PoolService, UnscoredPool

__all__ = ["Scores", "score_pools"]


@dataclasses.dataclass(frozen=True, slots=True)
class Scores:
    """Every scored pool, best first (:meth:`PoolScore.rank`), and the pools that
    could not be scored, in name order."""

    scores: tuple[PoolScore, ...]
    unscored: tuple[UnscoredPool, ...]


def score_pools(
    pools: Mapping[str, PoolService],
    may_observe: Callable[[str], bool],
    candidates: Sequence[str],
    num_tokens: int,
    prompts: Sequence[tuple[HashSettings, Sequence[bytes]]],
    tenant: str = "",
) -> Scores:
    """Score a prompt in each candidate pool (every observable pool without candidates).

    Args:
        pools: the server's pools by name.
        may_observe: whether the caller holds the observe role on a pool.
        candidates: pool names; empty = every pool ``may_observe`` accepts.
        num_tokens: the prompt's length in tokens (>= 1).
        prompts: the prompt's block hashes per hash settings (at most one each).
        tenant: the caller's tenant (whose prefix-cache namespace is searched).

    Raises:
        ServiceError: INVALID_ARGUMENT (num_tokens < 1, a pool named twice, two
            prompts with the same settings, hashes a pool refuses), PERMISSION_DENIED
            (a candidate the caller may not observe, known or not), NOT_FOUND (an
            unknown candidate the caller could observe).
    """
    if type(num_tokens) is not int or num_tokens < 1:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"num_tokens must be >= 1, got {num_tokens!r}")
    by_settings: dict[HashSettings, Sequence[bytes]] = {}
    for settings, hashes in prompts:
        if settings in by_settings:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"two prompts hashed with the same settings {settings!r}: send each settings once",
            )
        by_settings[settings] = hashes
    if candidates:
        if len(set(candidates)) != len(candidates):
            twice = sorted({c for c in candidates if candidates.count(c) > 1})
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"candidate_pools names {twice[0][:128]!r} more than once"
            )
        for name in candidates:
            if not may_observe(name):
                raise ServiceError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the caller lacks the observe role on pool {name[:128]!r} (ScorePools needs it)",
                )
            if name not in pools:
                raise ServiceError(
                    grpc.StatusCode.NOT_FOUND,
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
    return Scores(tuple(scored), tuple(unscored))
