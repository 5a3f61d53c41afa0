"""Whether an Attach may open a session on a pool: the hash handshake (the client's
profile and hash settings must be the pool's) and the pool's admission (a restart's
grace period, exclusive sessions and pools keeping step state, the tenant's session
limit). Checked in that order before the session is made; a refusal changes nothing.
:meth:`~.pool_service.PoolService.attach` asks them (this module imports nothing of
pool_service.py: :class:`~.pool_core.PoolCore` is what it reads)."""

from __future__ import annotations

from kvcoord.engine.profiles import VLLM_016

from .errors import ErrorReason, ServiceError, Status
from .pool_core import PoolCore

__all__ = ["check_admission", "check_handshake"]


def check_handshake(
    pool: PoolCore,
    hash_algo: str,
    hash_block_size: int,
    hash_seed: str,
    profile: str,
    num_hash_lookahead_tokens: int,
) -> None:
    """The client's profile ("": vllm-0.16) and hash settings against the pool's.

    Raises:
        ServiceError: FAILED_PRECONDITION when the client follows another profile
            (PROFILE_MISMATCH), or naming each hash difference (HASH_MISMATCH).
    """
    mine = pool.config.profile
    theirs = profile or VLLM_016
    if theirs != mine:
        raise ServiceError(
            Status.PRECONDITION,
            f"pool {pool.name!r} follows profile {mine!r} but the client follows {theirs[:64]!r}: "
            "its hashes and the pool's answers would not agree; attach with the pool's profile",
            ErrorReason.PROFILE_MISMATCH,
        )
    algo, block_size, seed = pool.hash_settings
    diffs = []
    if hash_algo != algo:
        diffs.append(f"hash_algo is {algo!r} but the client uses {hash_algo[:64]!r}")
    if hash_block_size != block_size:
        diffs.append(f"hash_block_size is {block_size} but the client uses {hash_block_size}")
    if hash_seed != seed:
        diffs.append(f"hash_seed is {seed!r} but the client uses {hash_seed[:64]!r}")
    lag = pool.config.num_hash_lookahead_tokens
    if num_hash_lookahead_tokens != lag:
        diffs.append(f"num_hash_lookahead_tokens is {lag} but the client uses {num_hash_lookahead_tokens}")
    if diffs:
        raise ServiceError(
            Status.PRECONDITION,
            f"pool {pool.name!r} hashes differently, so no prefix would ever hit: " + "; ".join(diffs),
            ErrorReason.HASH_MISMATCH,
        )


def check_admission(
    pool: PoolCore, grace_until: float, exclusive: bool, tenant: str, max_sessions: int
) -> None:
    """Whether ``tenant`` may open a session (``exclusive``: the pool's only one) now.

    Raises:
        ServiceError: UNAVAILABLE (GRACE_PERIOD) before ``grace_until`` (right after a
            restart); FAILED_PRECONDITION (POOL_EXCLUSIVE) when an exclusive session would
            share the pool, the pool has one, or a pool keeping step state (0.33 partial
            hits, mamba, zeroing) has any; RESOURCE_EXHAUSTED when the tenant already has
            ``max_sessions`` (0: the pool's max_sessions_per_tenant) live sessions.
    """
    wait = grace_until - pool.grace_clock()
    if wait > 0:
        raise ServiceError(
            Status.UNAVAILABLE,
            f"the server restarted while leases of its previous instance may still run; pool "
            f"{pool.name!r} hands out no block for another {wait:.1f} s (retry then)",
            ErrorReason.GRACE_PERIOD,
        )
    others = pool.sessions.of_pool(pool.name)
    state = pool.engine.scheduler_state() if others else ""
    if state:  # (the pool's, not a session's: another session would take or clear it)
        raise ServiceError(
            Status.PRECONDITION,
            f"pool {pool.name!r} has {state}: it already has {len(others)} session(s); attach once it ends",
            ErrorReason.POOL_EXCLUSIVE,
        )
    holder = next((o for o in others if o.exclusive), None)
    if holder is not None or (exclusive and others):
        if holder is None:
            # Other tenants' sessions are not counted to this one (nor named).
            own = sum(1 for o in others if o.tenant == tenant)
            whose = f"{own} session(s) of your tenant" if own == len(others) else "sessions of other tenants"
            if 0 < own < len(others):
                whose += f" and {own} of yours"
            message = f"pool {pool.name!r} has {whose}; an exclusive session must be the only one"
        else:
            # The holder's client is named to its own tenant only.
            whose = f"({holder.client_name!r})" if holder.tenant == tenant else "of another tenant"
            message = f"pool {pool.name!r} has an exclusive session {whose}; no other may attach"
        raise ServiceError(Status.PRECONDITION, message, ErrorReason.POOL_EXCLUSIVE)
    limit = max_sessions or pool.limits.max_sessions_per_tenant
    live = pool.sessions.count_of_tenant(tenant)
    if live >= limit:
        raise ServiceError(
            Status.EXHAUSTED,
            f"tenant {tenant or '(full access)'!r} already has {live} live sessions "
            f"(max_sessions_per_tenant {limit}); detach unused ones or let their leases end",
        )
