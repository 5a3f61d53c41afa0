"""KVCachePool.decode_run (a decode step's entries in columns, in one engine call)
applies every entry it takes exactly as update_and_allocate's general path would, and
leaves the rest untouched for it.

Two pools of one layout get the same random decode steps as columns: one applies them
as the service's DecodeOp does (decode_run, each entry it leaves to
update_and_allocate, then decode_run again), the other one entry at a time through
update_and_allocate with both fast paths off. After every step their answers (new
blocks per entry and group, the failing entry and its error), whole states, events,
statistics and refusals must be equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import kvcoord.engine.decode_run as decode_run
import pytest
from kvcoord.engine import Counts, EngineError, KVCachePool, TokenIds
from unit.test_decode_fast_path import LAYOUTS, MAX_LEN, Twins, observed


@dataclasses.dataclass
class Columns:
    """A DecodeOp's columns (the service's RunColumns, as the engine reads them)."""

    request_ids: list[str] = dataclasses.field(default_factory=list)
    base_num_tokens: list[int] = dataclasses.field(default_factory=list)
    base_num_hashes: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)
    num_new_tokens: list[int] = dataclasses.field(default_factory=list)
    num_lookahead_tokens: list[int] = dataclasses.field(default_factory=list)
    num_append_tokens: list[int] = dataclasses.field(default_factory=list)
    append_token_ids: Sequence[int] = dataclasses.field(default_factory=list)
    num_append_hashes: list[int] = dataclasses.field(default_factory=list)
    append_block_hashes: list[bytes] = dataclasses.field(default_factory=list)


Answer = tuple[list[int], list[int], object]


def by_run(pool: KVCachePool, cols: Columns) -> tuple[Answer, int]:
    """The entries as the service's DecodeOp applies them: runs through decode_run, each
    entry it leaves through update_and_allocate. Returns the answer and how many
    entries decode_run took."""
    n, groups = len(cols.request_ids), len(pool.managers)
    counts, ids = [0] * (n * groups), []
    i = t = h = taken = 0
    while i < n:
        j, t, h = pool.decode_run(cols, i, n, t, h, counts, ids)
        taken += j - i
        i = j
        if i == n:
            break
        nt, nh = cols.num_append_tokens[i], cols.num_append_hashes[i]
        try:
            new = pool.update_and_allocate(
                cols.request_ids[i], cols.num_computed_tokens[i], list(cols.append_token_ids[t : t + nt]),
                cols.append_block_hashes[h : h + nh], cols.num_new_tokens[i], cols.num_lookahead_tokens[i],
            )  # fmt: skip
        except EngineError as err:
            return (counts[: i * groups], ids, (i, type(err).__name__, str(err))), taken
        t += nt
        h += nh
        if new is None:
            counts[i * groups : (i + 1) * groups] = [-1] * groups
        else:
            for g, group in enumerate(new):
                counts[i * groups + g] = len(group)
                ids += group
        i += 1
    return (counts, ids, None), taken


def one_by_one(pool: KVCachePool, cols: Columns) -> Answer:
    """The same entries one update_and_allocate call each (the pool's fast paths off)."""
    counts: list[int] = []
    ids: list[int] = []
    t = h = 0
    for i, rid in enumerate(cols.request_ids):
        nt, nh = cols.num_append_tokens[i], cols.num_append_hashes[i]
        try:
            new = pool.update_and_allocate(
                rid, cols.num_computed_tokens[i], list(cols.append_token_ids[t : t + nt]),
                cols.append_block_hashes[h : h + nh], cols.num_new_tokens[i], cols.num_lookahead_tokens[i],
            )  # fmt: skip
        except EngineError as err:
            return counts, ids, (i, type(err).__name__, str(err))
        t += nt
        h += nh
        groups = len(pool.managers)
        if new is None:
            counts += [-1] * groups
        else:
            for group in new:
                counts.append(len(group))
                ids += group
    return counts, ids, None


#: each kind of entry's weight in a mix: "random" is mostly plain decode steps among
#: every other kind; "decode" is a decode step's usual columns (each request's next
#: token), so that whole runs take the next-token loop, with an odd entry among them
KINDS = ("decode", "spec", "lookahead", "behind", "lag", "huge", "bad_token", "bad_hash", "no_hash",
         "extra_hash", "stale", "unknown", "bool", "nothing", "no_new", "twice")  # fmt: skip
MIXES = {
    "random": (60, 5, 6, 3, 5, 2, 2, 2, 2, 2, 2, 2, 1, 2, 1, 1),
    "decode": (400, 1, 1, 1, 1, 1, 1, 8, 1, 1, 1, 1, 1, 1, 1, 3),
}


class Steps(Twins):
    """Random decode steps of the running requests, as columns."""

    mix = "random"

    def entry(self, cols: Columns, rid: str) -> None:
        """One running request's entry: usually a plain decode step (inside its blocks,
        or one completing or crossing a block), sometimes one decode_run must leave to
        the general path (or a bad one both must refuse)."""
        rnd = self.rnd
        req = self.slow.requests[rid]
        n_tok = req.num_tokens
        computed = n_tok
        tokens = [rnd.randrange(60)]
        num_new, look = 1, 0
        kind = rnd.choices(KINDS, MIXES[self.mix])[0]
        if kind == "spec":
            tokens += [rnd.randrange(60) for _ in range(rnd.randint(1, 2))]
            num_new = len(tokens) + rnd.randint(0, 2)
        elif kind == "lookahead":
            look = rnd.randint(1, 5)
        elif kind == "behind":
            computed = max(n_tok - rnd.randint(1, 6), 0)
            num_new = n_tok + 1 - computed
        elif kind == "lag":  # the step before's token not computed yet (async scheduling)
            computed = max(n_tok - 1, 0)
        elif kind == "huge":
            num_new = MAX_LEN
        elif kind == "nothing":
            tokens = []
        elif kind == "no_new":
            num_new = 0
        hashes = self.hashes_for(rid, tokens)
        if kind == "bad_token":
            tokens[0] = -1
        elif kind == "bad_hash":
            hashes = [rnd.choice((b"\x01" * 7, b""))] if hashes else hashes  # (b"": no hash)
        elif kind == "no_hash":
            hashes = []
        elif kind == "extra_hash":
            hashes = hashes + [b"\x01" * 32]
        elif kind == "bool":
            num_new = True  # type: ignore[assignment]
        listed = [r for r in cols.request_ids if r in self.slow.requests]
        if kind == "twice" and listed:  # a request listed again, at its position before the step
            rid = rnd.choice(listed)
            req = self.slow.requests[rid]
            n_tok = computed = req.num_tokens
            hashes = self.hashes_for(rid, tokens)
        cols.request_ids.append(f"gone{rnd.randrange(9)}" if kind == "unknown" else rid)
        cols.base_num_tokens.append(n_tok + (kind == "stale"))
        cols.base_num_hashes.append(len(req.block_hashes))
        cols.num_computed_tokens.append(computed)
        cols.num_new_tokens.append(num_new)
        cols.num_lookahead_tokens.append(look)
        cols.num_append_tokens.append(len(tokens))
        cols.append_token_ids += tokens  # type: ignore[operator]
        cols.num_append_hashes.append(len(hashes))
        cols.append_block_hashes += hashes

    def step(self, running: list[str]) -> int:
        """One decode step of ``running`` on both pools; returns the entries decode_run took."""
        cols = Columns()
        if self.rnd.random() < 0.5:
            cols.append_token_ids = TokenIds()  # as the wire reader hands them
        for rid in running:
            self.entry(cols, rid)
        if type(cols.append_token_ids) is TokenIds and min(cols.append_token_ids, default=0) < 0:
            cols.append_token_ids = list(cols.append_token_ids)  # (TokenIds vouch for >= 0)
        for name in ("num_computed_tokens", "num_new_tokens", "num_lookahead_tokens", "num_append_hashes"):
            column = getattr(cols, name)
            if self.rnd.random() < 0.5 and all(type(v) is int and v >= 0 for v in column):
                setattr(cols, name, Counts(column))  # as the wire reader hands them (Counts vouch for >= 0)
        fast, taken = by_run(self.fast, cols)
        slow = one_by_one(self.slow, cols)
        assert fast == slow, cols
        assert observed(self.fast) == observed(self.slow), cols
        return taken


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decode_run_equals_the_general_path(layout: str, mix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    t = Steps(layout, seed=7 + sum(map(ord, layout + mix)))
    t.mix = mix
    next_token = {"entries": 0}
    inner = decode_run._run_next_token

    def counted(*a: Any) -> tuple[int, int, int]:
        got = inner(*a)
        next_token["entries"] += got[0] - a[2]
        return got

    monkeypatch.setattr(decode_run, "_run_next_token", counted)
    rnd = t.rnd
    prefixes = [[rnd.randrange(60) for _ in range(n)] for n in (3, 8, 13)]
    running: list[str] = []
    taken = 0
    for step in range(250):
        while len(running) < (6 if mix == "random" else 10) and rnd.random() < 0.6:
            rid = f"r{step}-{len(running)}"
            if not t.admit(rid, prefixes):
                break
            running.append(rid)
        taken += t.step(running)
        for rid in list(running):
            req = t.slow.requests[rid]
            if rnd.random() < 0.05 or (req.num_tokens >= MAX_LEN - 2 and rnd.random() < 0.5):
                t.both("free", rid)
                running.remove(rid)
    if t.fast.decode_fast_path:
        assert taken > 300, taken
    else:
        assert taken == 0
    config = t.fast.config
    if len(config.groups) > 1 or not config.enable_caching or config.num_hash_lookahead_tokens:
        assert next_token["entries"] == 0, next_token  # (pools the next-token loop does not serve)
    elif mix == "decode":
        assert next_token["entries"] > 500, next_token
