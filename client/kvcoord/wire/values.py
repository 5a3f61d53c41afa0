"""Block ids, an allocation's arguments, prefix hits, LoRA adapters, a request's extra-key sources and prefix-cache
statistics: engine values <-> messages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, overload

from kvcoord.engine import CacheHit, LoRA, PrefixCacheStats
from kvcoord.engine.extra_keys import ExtraKeySources, MultiModalItem
from kvcoord.v1 import allocator_pb2 as pb

__all__ = [
    "STATS_FIELDS",
    "allocate_op",
    "block_ids_to_pb",
    "extra_key_sources_from_pb",
    "free_op",
    "write_extra_key_sources",
    "hit_from_pb",
    "hit_to_pb",
    "ids_from_pb",
    "lora_from_pb",
    "score_rank",
    "stats_from_pb",
    "stats_to_pb",
    "uncomputed_from_pb",
    "write_ids",
]

#: The fields of PrefixCacheStats, the same on both sides.
STATS_FIELDS = (
    "reset", "requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits",
)  # fmt: skip


def block_ids_to_pb(lists: Sequence[Sequence[int]]) -> list[pb.BlockIds]:
    """One BlockIds per group."""
    return [pb.BlockIds(block_ids=list(ids)) for ids in lists]


def write_ids(target: Any, lists: Iterable[Sequence[int]]) -> None:
    """Append one BlockIds per group to the repeated field ``target``, in place (no
    message built and then copied)."""
    for ids in lists:
        target.add().block_ids.extend(ids)


def ids_from_pb(groups: Iterable[pb.BlockIds]) -> tuple[tuple[int, ...], ...]:
    """Each group's block ids, in order."""
    return tuple(tuple(g.block_ids) for g in groups)


def hit_to_pb(hit: CacheHit) -> pb.CacheHit:
    return pb.CacheHit(groups=block_ids_to_pb(hit.block_ids), num_tokens=hit.num_tokens)


def hit_from_pb(hit: pb.CacheHit) -> CacheHit | None:
    """``None`` when no groups were sent (no hit to adopt)."""
    if not hit.groups:
        return None
    return CacheHit(ids_from_pb(hit.groups), hit.num_tokens)


def lora_from_pb(lora: pb.LoRA) -> LoRA | None:
    """``None`` for an unnamed adapter (no LoRA)."""
    return LoRA(lora.adapter_id, lora.name) if lora.name else None


def extra_key_sources_from_pb(sync: pb.RequestSync) -> ExtraKeySources | None:
    """A RequestSync's multimodal items and prompt-embeds digests (``None``: neither)."""
    if not sync.mm_items and not sync.prompt_embeds_digests:
        return None
    return ExtraKeySources(
        tuple(MultiModalItem(m.identifier, m.offset, m.length) for m in sync.mm_items),
        tuple(sync.prompt_embeds_digests) if sync.prompt_embeds_digests else None,
    )


def write_extra_key_sources(sources: ExtraKeySources, sync: pb.RequestSync) -> None:
    """Write ``sources`` into a new request's sync."""
    for m in sources.mm_items:
        sync.mm_items.add(identifier=m.identifier, offset=m.offset, length=m.length)
    if sources.embeds_digests is not None:
        sync.prompt_embeds_digests.extend(sources.embeds_digests)


@overload
def stats_to_pb(stats: PrefixCacheStats) -> pb.PrefixCacheStats: ...
@overload
def stats_to_pb(stats: None) -> None: ...
def stats_to_pb(stats: PrefixCacheStats | None) -> pb.PrefixCacheStats | None:
    if stats is None:
        return None
    return pb.PrefixCacheStats(**{f: getattr(stats, f) for f in STATS_FIELDS})


def stats_from_pb(stats: pb.PrefixCacheStats) -> PrefixCacheStats:
    return PrefixCacheStats(**{f: getattr(stats, f) for f in STATS_FIELDS})


def allocate_op(
    sync: pb.RequestSync | None,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Sequence[Sequence[int]] | None = None,
    num_lookahead_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
    lookup: bool = False,
    into: pb.AllocateOp | None = None,
) -> pb.AllocateOp:
    """allocate_slots' arguments as an AllocateOp carrying a copy of ``sync`` (an empty
    hit is sent as none); written into ``into`` when given, whose request sync the
    caller fills in place (``sync`` is then ``None``: a long prompt is not copied)."""
    op = pb.AllocateOp() if into is None else into
    if sync is not None:
        op.request.CopyFrom(sync)
    op.num_new_tokens = num_new_tokens
    op.num_new_computed_tokens = num_new_computed_tokens
    op.num_lookahead_tokens = num_lookahead_tokens
    op.num_external_computed_tokens = num_external_computed_tokens
    op.delay_cache_blocks = delay_cache_blocks
    op.num_encoder_tokens = num_encoder_tokens
    op.lookup = lookup
    if new_computed_blocks is not None and any(new_computed_blocks):
        op.new_computed_blocks.groups.extend(block_ids_to_pb(new_computed_blocks))
        op.new_computed_blocks.num_tokens = num_new_computed_tokens
    return op


def free_op(
    request_id: str,
    *,
    if_held: bool = False,
    uncomputed_from: int | None = None,
    into: pb.FreeOp | None = None,
) -> pb.FreeOp:
    """A FreeOp, written into ``into`` when given; ``uncomputed_from`` (an undone step's
    free: see the engine's ``free``) is set only when given."""
    op = pb.FreeOp() if into is None else into
    op.request_id = request_id
    if if_held:
        op.if_held = True
    if uncomputed_from is not None:
        op.uncomputed_from = uncomputed_from
    return op


def uncomputed_from_pb(op: pb.FreeOp) -> int | None:
    """A FreeOp's ``uncomputed_from`` (``None``: a plain free)."""
    return op.uncomputed_from if op.HasField("uncomputed_from") else None


def score_rank(score: pb.PoolScore) -> tuple[int, int, str]:
    """A ScorePools answer's order, best first: the longest hit, then the most free
    blocks, then the pool's name (the router's policy; the server's ``PoolScore.rank``
    on its own values)."""
    return (-score.hit_tokens, -score.num_free_blocks, score.pool)
