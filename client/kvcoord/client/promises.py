"""How many free blocks one ``allocate_slots`` can take, from what the client knows.

With an exclusive session the manager knows the pool's free blocks exactly (from the
last answer, less what its unsent promises may take). An allocation whose bound fits
is answered at once and sent with the next Step, where the server checks it
(``must_succeed``): a wrong bound is a loud PREDICTION_FAILED, never a silent refusal.

For attention groups that hold one block per ``block_size`` tokens from position 0
(full, sliding window, chunked local) vLLM allocates exactly
``ceil(tokens needing a slot / block_size) - len(table)`` new blocks, so once a
request's table lengths are known (from its first allocation on) the bound is exact
but for adopted hit blocks leaving the free queue. Everything else (mamba state,
cross-attention, requests whose history the client does not know) gets a generous
bound instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kvcoord.v1 import allocator_pb2 as pb

__all__ = ["BlockBudget", "BlockLedger"]

logger = logging.getLogger(__name__)

_POSITIONAL = frozenset({"full", "sliding_window", "chunked_local"})


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockBudget:
    """Table lengths of the session's requests, and the bound they give.

    Args:
        groups: the pool's KV cache groups.
        max_model_len: the pool's (0 = unlimited).
    """

    def __init__(self, groups: Sequence[pb.KVCacheGroupSpec], max_model_len: int) -> None:
        self.kinds = [g.WhichOneof("spec") or "full" for g in groups]
        self.block_sizes = [
            max(1, int(getattr(getattr(g, k), "block_size", 1)))
            for g, k in zip(groups, self.kinds, strict=True)
        ]
        self.extra = [
            (2 + g.mamba.num_speculative_blocks) if k == "mamba" else 0
            for g, k in zip(groups, self.kinds, strict=True)
        ]
        self.max_model_len = max_model_len or (1 << 62)
        #: per request, its table length per group (positional groups only are exact)
        self.lengths: dict[str, list[int]] = {}
        #: turned off for good if an answer ever disagrees with the tracked lengths
        self.exact = True

    def bound(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit: Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_encoder_tokens: int = 0,
    ) -> tuple[int, list[int] | None, list[int] | None]:
        """(blocks the call may take at most, table lengths before and after it, each
        None when unknown)."""
        mml = self.max_model_len
        total = min(num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens, mml)
        need_slot = min(total + num_new_tokens + num_lookahead_tokens, mml)
        known = self.lengths.get(request_id) if self.exact else None
        if known is None and self.exact and num_computed_tokens == 0:
            # a first allocation: the table is the adopted hit (null blocks included)
            known = [len(hit[g]) if hit is not None and g < len(hit) else 0 for g in range(len(self.kinds))]
        span = num_new_tokens + num_lookahead_tokens + num_external_computed_tokens
        out = 0
        after: list[int] | None = [] if known is not None else None
        for g, kind in enumerate(self.kinds):
            bs = self.block_sizes[g]
            adopted = sum(1 for b in hit[g] if b) if hit is not None and g < len(hit) else 0
            if kind in _POSITIONAL and known is not None and after is not None:
                required = _cdiv(need_slot, bs)
                out += max(0, required - known[g]) + adopted
                after.append(max(known[g], required))
                continue
            out += _cdiv(span, bs) + 1 + adopted + self.extra[g]
            if kind == "cross_attention":
                out += _cdiv(num_encoder_tokens, bs) + 1
            if after is not None:
                after.append(known[g] if known is not None else 0)  # not tracked: unchanged
        return out, known, after

    def applied(self, request_id: str, after: list[int] | None) -> None:
        """The allocation took effect (or is promised to): remember the new lengths."""
        if after is None:
            self.lengths.pop(request_id, None)
        else:
            self.lengths[request_id] = after

    def verify(
        self, request_id: str, before: list[int], after: list[int], new_ids: Sequence[Sequence[int]]
    ) -> None:
        """Compare an answer with the lengths it was promised against; any disagreement
        turns exact tracking off for good (bounds stay safe, only less tight)."""
        for g, kind in enumerate(self.kinds):
            if kind in _POSITIONAL and after[g] - before[g] != len(new_ids[g]):
                logger.warning(
                    "allocation of %s took %d blocks in group %d, %d expected: exact bounds turned off",
                    request_id,
                    len(new_ids[g]),
                    g,
                    after[g] - before[g],
                )
                self.exact = False
                self.lengths.clear()
                return

    def forget(self, request_id: str) -> None:
        self.lengths.pop(request_id, None)

    def clear(self) -> None:
        self.lengths.clear()


@dataclasses.dataclass(slots=True)
class _Held:
    """One request's blocks: ids known, and new blocks promised but not yet named."""

    ids: list[int] = dataclasses.field(default_factory=list)
    unnamed: int = 0
    freed: bool = False


class BlockLedger:
    """Every block the requests of a pool's only session hold, for pools whose groups
    are all full attention (tables only grow; a free releases the whole table).

    With it the manager knows the pool's free blocks exactly after any sequence of its
    own calls, so it can answer refusals as well as successes without a round trip
    (the server checks both: ``must_succeed`` / ``must_refuse``). Block ids come from
    answers; a promised allocation's new blocks are counted as held by that request
    alone until its answer names them (no other request can adopt a block before
    its id is known to the client).
    """

    def __init__(self) -> None:
        #: references per block id (null block never counted)
        self.refs: dict[int, int] = {}
        self.held: dict[str, _Held] = {}

    def need(self, hit: Sequence[Sequence[int]] | None, new_blocks: int) -> int:
        """vLLM's count for an allocation: its new blocks plus adopted hit blocks that
        are free now (they leave the free queue)."""
        if not hit:
            return new_blocks
        refs = self.refs
        return new_blocks + sum(1 for group in hit for b in group if b and not refs.get(b))

    def allocated(self, request_id: str, hit: Sequence[Sequence[int]] | None, new_blocks: int) -> _Held:
        """The allocation took effect (or is promised): the hit is adopted and
        ``new_blocks`` are held, to be named by :meth:`named`."""
        h = self.held.get(request_id)
        if h is None:
            h = self.held[request_id] = _Held()
        if hit:
            refs = self.refs
            for group in hit:
                for b in group:
                    if b:
                        refs[b] = refs.get(b, 0) + 1
                        h.ids.append(b)
        h.unnamed += new_blocks
        return h

    def named(self, h: _Held, new_ids: Sequence[Sequence[int]]) -> None:
        """An allocation's answer named its new blocks."""
        n = sum(len(g) for g in new_ids)
        h.unnamed -= n
        if h.freed:
            return  # freed before its answer came: counted as released then
        refs = self.refs
        for group in new_ids:
            for b in group:
                refs[b] = refs.get(b, 0) + 1
                h.ids.append(b)

    def release(self, request_id: str) -> tuple[int, list[int]]:
        """The request is freed: how many blocks become free (held by it alone), and
        the ids of those that are known (promised blocks not yet named are not)."""
        h = self.held.pop(request_id, None)
        if h is None:
            return 0, []
        h.freed = True
        refs = self.refs
        ids: list[int] = []
        for b in h.ids:
            n = refs.get(b, 0) - 1
            if n > 0:
                refs[b] = n
            else:
                refs.pop(b, None)
                ids.append(b)
        return h.unnamed + len(ids), ids

    def clear(self) -> None:
        self.refs.clear()
        self.held.clear()
