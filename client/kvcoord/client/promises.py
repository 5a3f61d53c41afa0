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

import logging
from collections.abc import Sequence

from kvcoord.v1 import allocator_pb2 as pb

__all__ = ["BlockBudget"]

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
