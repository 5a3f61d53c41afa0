"""vLLM 0.33's per-step mamba hand-offs: boundary-state offloads and copy-on-write
pairs, engine values <-> messages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvcoord.v1 import allocator_pb2 as pb

__all__ = ["copies_from_pb", "copies_to_pb", "offloads_from_pb", "offloads_to_pb"]

#: per request, its ``(group, block id, boundary tokens)`` entries
Offloads = Mapping[str, Sequence[tuple[int, int, int]]]


def offloads_to_pb(offloads: Offloads) -> pb.TakeBoundaryStateOffloadsResult:
    """One BoundaryStateOffload per entry, request by request."""
    return pb.TakeBoundaryStateOffloadsResult(
        offloads=[
            pb.BoundaryStateOffload(request_id=rid, group_id=g, block_id=b, boundary_tokens=t)
            for rid, entries in offloads.items()
            for g, b, t in entries
        ]
    )


def offloads_from_pb(result: pb.TakeBoundaryStateOffloadsResult) -> dict[str, list[tuple[int, int, int]]]:
    """The engine's form again: entries grouped by request, in order."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for o in result.offloads:
        out.setdefault(o.request_id, []).append((o.group_id, o.block_id, o.boundary_tokens))
    return out


def copies_to_pb(
    copies: Iterable[tuple[int, int]], retained: Iterable[int]
) -> pb.TakeKVCacheBlockCopiesResult:
    return pb.TakeKVCacheBlockCopiesResult(
        copies=[pb.KVCacheBlockCopy(src_block_id=s, dst_block_id=d) for s, d in copies],
        retained_block_ids=list(retained),
    )


def copies_from_pb(result: pb.TakeKVCacheBlockCopiesResult) -> tuple[list[tuple[int, int]], list[int]]:
    """``(src, dst)`` pairs and the retained block ids."""
    return [(c.src_block_id, c.dst_block_id) for c in result.copies], list(result.retained_block_ids)
