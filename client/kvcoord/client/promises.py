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
from kvcoord.wire import group_kinds

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
        self.kinds = group_kinds(groups)
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


#: a table position whose new block is promised but not yet named by an answer
UNNAMED = -1


@dataclasses.dataclass(slots=True)
class _Held:
    """One request's table per group: block ids by position, 0 for the null block,
    ``UNNAMED`` for new blocks promised but not yet named."""

    tables: list[list[int]]
    freed: bool = False


@dataclasses.dataclass(slots=True)
class Promise:
    """Where an allocation's new blocks go, until its answer names them."""

    held: _Held
    positions: list[range]


class BlockLedger:
    """Every block the requests of a pool's only session hold, for pools whose groups
    are full attention or sliding window, with vLLM's rules: an allocation first nulls
    the sliding-window blocks that left the window (so does ``remove_skipped_blocks``),
    a new request adopts its hit past the skipped blocks, tables grow at the end, a
    free releases the whole table; a block is free when no table holds it.

    With it the manager knows the pool's free blocks exactly after any sequence of its
    own calls, so it can answer refusals as well as successes without a round trip (the
    server checks both: ``must_succeed`` / ``must_refuse``). Block ids come from answers;
    a promised allocation's new blocks are held by that request alone until its answer
    names them (no other request can adopt a block before its id is known here).

    Args:
        block_sizes: per group, its block size.
        windows: per group, the sliding window in tokens (0 for full attention).
    """

    def __init__(self, block_sizes: Sequence[int], windows: Sequence[int]) -> None:
        self.block_sizes = list(block_sizes)
        self.windows = list(windows)
        self._sliding = [g for g, w in enumerate(self.windows) if w]
        #: some group is a sliding window (skip() may release blocks)
        self.has_windows = bool(self._sliding)
        #: references per block id (null block never counted)
        self.refs: dict[int, int] = {}
        self.held: dict[str, _Held] = {}

    def _skipped(self, group: int, total_computed_tokens: int) -> int:
        """Leading blocks of ``group`` outside the window after that many tokens."""
        w = self.windows[group]
        return max(0, total_computed_tokens - w + 1) // self.block_sizes[group] if w else 0

    def skips(self, request_id: str, total_computed_tokens: int) -> bool:
        """Whether :meth:`skip` would null any block (nothing changes)."""
        h = self.held.get(request_id)
        if h is None:
            return False
        for g in self._sliding:
            table = h.tables[g]
            k = min(self._skipped(g, total_computed_tokens), len(table))
            if k > 0 and table[k - 1] != 0:
                return True
        return False

    def skip(self, request_id: str, total_computed_tokens: int) -> tuple[int, list[int]]:
        """vLLM's ``remove_skipped_blocks``: blocks that left the window become null.
        Returns how many blocks become free, and the ids of those that are named."""
        h = self.held.get(request_id)
        if h is None or not self._sliding:
            return 0, []
        refs = self.refs
        released: list[int] = []
        unnamed = 0
        for g in self._sliding:
            table = h.tables[g]
            for i in range(min(self._skipped(g, total_computed_tokens), len(table)) - 1, -1, -1):
                b = table[i]
                if b == 0:
                    break
                table[i] = 0
                if b == UNNAMED:
                    unnamed += 1  # held by this request alone
                    continue
                n = refs.get(b, 0) - 1
                if n > 0:
                    refs[b] = n
                else:
                    refs.pop(b, None)
                    released.append(b)
        return unnamed + len(released), released

    def need(
        self,
        request_id: str,
        hit: Sequence[Sequence[int]] | None,
        new_blocks: Sequence[int],
        total_computed_tokens: int,
    ) -> int:
        """vLLM's count for an allocation: its new blocks plus the adopted hit blocks
        (past the skipped ones) that are free now, since they leave the free queue."""
        out = sum(new_blocks)
        if not hit or request_id in self.held:
            return out  # a request holding blocks adopts no hit
        refs = self.refs
        for g, group in enumerate(hit):
            for b in group[self._skipped(g, total_computed_tokens) :]:
                if b and not refs.get(b):
                    out += 1
        return out

    def allocated(
        self,
        request_id: str,
        hit: Sequence[Sequence[int]] | None,
        new_blocks: Sequence[int],
        total_computed_tokens: int,
    ) -> Promise:
        """The allocation took effect (or is promised): the hit is adopted and the new
        blocks are held, to be named by :meth:`named`."""
        h = self.held.get(request_id)
        if h is None:
            h = self.held[request_id] = _Held([[] for _ in self.block_sizes])
            if hit:
                refs = self.refs
                for g, group in enumerate(hit):
                    skipped = min(self._skipped(g, total_computed_tokens), len(group))
                    table = h.tables[g]
                    table.extend([0] * skipped)
                    for b in group[skipped:]:
                        table.append(b)
                        if b:
                            refs[b] = refs.get(b, 0) + 1
        positions = []
        for table, n in zip(h.tables, new_blocks, strict=True):
            positions.append(range(len(table), len(table) + n))
            table.extend([UNNAMED] * n)
        return Promise(h, positions)

    def adopt_table(self, request_id: str, table: Sequence[Sequence[int]]) -> None:
        """A request not held here now holds ``table`` (per group, every block by
        position, 0 for null): what an answer that returns the whole table says after
        an allocation this ledger could not follow (blocks taken for a connector's
        external tokens are not among the new ids)."""
        assert request_id not in self.held
        refs = self.refs
        self.held[request_id] = _Held([list(g) for g in table])
        for group in table:
            for b in group:
                if b:
                    refs[b] = refs.get(b, 0) + 1

    def table(self, request_id: str) -> tuple[list[int], ...] | None:
        """The request's table per group (copies), or ``None`` when it holds none here
        or a promised block of it is not named yet."""
        h = self.held.get(request_id)
        if h is None or any(UNNAMED in t for t in h.tables):
            return None
        return tuple(list(t) for t in h.tables)

    def named(self, promise: Promise, new_ids: Sequence[Sequence[int]]) -> None:
        """An allocation's answer named its new blocks (positions already nulled or a
        request already freed keep nothing)."""
        h = promise.held
        if h.freed:
            return
        refs = self.refs
        for table, where, ids in zip(h.tables, promise.positions, new_ids, strict=True):
            for pos, b in zip(where, ids, strict=False):
                if table[pos] == UNNAMED:
                    table[pos] = b
                    if b:
                        refs[b] = refs.get(b, 0) + 1

    def release(self, request_id: str) -> tuple[int, list[int]]:
        """The request is freed: how many blocks become free (held by it alone), and
        the ids of those that are named."""
        h = self.held.pop(request_id, None)
        if h is None:
            return 0, []
        h.freed = True
        refs = self.refs
        ids: list[int] = []
        unnamed = 0
        for table in h.tables:
            for b in table:
                if b == UNNAMED:
                    unnamed += 1
                elif b:
                    n = refs.get(b, 0) - 1
                    if n > 0:
                        refs[b] = n
                    else:
                        refs.pop(b, None)
                        ids.append(b)
        return unnamed + len(ids), ids
