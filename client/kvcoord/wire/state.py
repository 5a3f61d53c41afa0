"""An exclusive session's starting point (AttachResponse.pool_state): the engine's
:meth:`~kvcoord.engine.KVCachePool.replica_state` <-> PoolState."""

from __future__ import annotations

from kvcoord.v1 import allocator_pb2 as pb

__all__ = ["ReplicaState", "pool_state_from_pb", "write_pool_state"]

#: (first never-used block, used free blocks head first, (hash, block) pairs in cache order)
ReplicaState = tuple[int, list[int], list[tuple[bytes, int]]]


def write_pool_state(response: pb.AttachResponse, state: ReplicaState | str) -> None:
    """An Attach answer's pool state, or why there is none (a string)."""
    if isinstance(state, str):
        response.pool_state_unavailable = state
        return
    fresh, used, pairs = state
    out = response.pool_state
    out.next_fresh = fresh
    out.used_free_blocks.extend(used)
    out.cached_block_ids.extend([block_id for _, block_id in pairs])
    out.cached_block_hashes.extend([block_hash for block_hash, _ in pairs])


def pool_state_from_pb(response: pb.AttachResponse) -> ReplicaState | str:
    """What :func:`write_pool_state` wrote: the state, or why there is none.

    Raises:
        ValueError: the cached ids and hashes differ in length.
    """
    if not response.HasField("pool_state"):
        return response.pool_state_unavailable or "the server sent no pool state"
    s = response.pool_state
    pairs = list(zip(s.cached_block_hashes, s.cached_block_ids, strict=True))
    return s.next_fresh, list(s.used_free_blocks), pairs
