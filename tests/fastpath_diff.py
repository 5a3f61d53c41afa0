"""A differential fuzz of the engine's decode fast paths against its general path,
shared by tests/unit/test_fast_path_differential.py and bench/fastpath_diff.py.

Four pools of one layout get the same random scheduler workload:

* ``client``: a running request's step as the predicted client makes it
  (``decode_token``, then ``decode_step``, then ``update_and_allocate(...,
  inside_checked=True)``; any other step ``update_and_allocate``);
* ``uaa``: every step through ``update_and_allocate`` (its own decode fast path on);
* ``general``: ``update_request`` then ``allocate_slots`` (the update taken back when the
  allocation raises, as the service does), every fused path of the pool off
  (``allocate_slots`` without hit, decode fast paths, the fused free): the coordinator's
  general path throughout;
* ``run``: each step's entries as columns through ``decode_run`` (random slices), each
  entry it leaves through ``update_and_allocate``, as the service's DecodeOp applies
  them.

Before each entry ``allocation_changes_nothing`` is asked of the client's pool: when
it says the allocation changes nothing, an entry that succeeds must take, cache and
free no block.

Every other call (admissions with and without a prefix hit, frees, preemptions,
``evict_blocks``, ``reset_prefix_cache``, ``new_step_starts``) goes to all four. After
every call the answers (or errors: type and message) and whole observable states
(``export_state``, KV events, zeroing records) are compared; the ``run`` pool's after
each step (its answers entry by entry, its events the step's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from typing import Any

from fastpath_parts import (
    BS,
    LAYOUTS,
    ODD_VALUES,
    Bytes,
    answer,
    drain,
    first_difference,
    make_general,
    observed,
    token_list,
)
from kvcoord.engine import Counts, KVCacheConfig, KVCachePool, LoRA, TokenIds
from kvcoord.engine.decode_run import DecodeColumns
from kvcoord.engine.state import export_state

__all__ = ["LAYOUTS", "Diff", "make_general", "run"]


@dataclasses.dataclass
class Entry:
    """One running request's step (an AllocateRun / DecodeOp entry)."""

    rid: str
    base_t: int
    base_h: int
    computed: Any
    tokens: Sequence[Any]
    hashes: Sequence[Any]
    num_new: Any
    look: Any


class Diff:
    """The four pools of one layout and a random workload on them (see the module)."""

    NAMES = ("client", "uaa", "general", "run")

    def __init__(self, layout: str, seed: int, num_blocks: int = 28) -> None:
        groups, kw = LAYOUTS[layout]
        kw = {"max_model_len": 45, **kw}
        self.config = KVCacheConfig(
            num_blocks=num_blocks, groups=groups, hash_block_size=BS, enable_kv_cache_events=True, **kw
        )
        self.pools = [KVCachePool(self.config) for _ in self.NAMES]
        self.client, self.uaa, self.general, self.run = self.pools
        make_general(self.general)
        self.rnd = random.Random(seed)
        self.max_len = self.config.max_model_len
        self.lag = self.config.num_hash_lookahead_tokens
        self.v33 = self.config.profile == "vllm-0.33"
        #: external (KV connector) tokens: vllm-0.16 pools (beside a mamba align group too:
        #: where vLLM 0.16's count leaves out the block the external tokens' state takes,
        #: every path refuses alike, UncountedBlocksError, changing nothing)
        self.external = not self.v33
        self.calls = 0  # differential calls made
        self.kinds: dict[str, int] = {}
        self.answered = dict.fromkeys(
            ("decode_token", "decode_step", "decode_run", "refused", "changes_nothing"), 0
        )
        self._hashes: dict[tuple[int, ...], bytes] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.sched: dict[str, int] = {}  # request -> tokens its last allocation covered
        self.serial = 0
        self.delayed: list[tuple[str, int]] = []  # (request, external tokens) whose caching waits
        self.reservations = 0
        self.prefixes = [[self.rnd.randrange(50) for _ in range(n)] for n in (3, 8, 13, 21)]

    # -- the comparison ---------------------------------------------------------------
    def all(self, name: str, *args: Any, **kw: Any) -> object:
        """The same call on every pool: answers and states must be equal."""
        got = [answer(getattr(p, name), *args, **kw) for p in self.pools]
        self.calls += 1
        self._same(got, (name, args, kw))
        return got[0]

    def _same(self, got: Sequence[object], what: object) -> None:
        assert all(g == got[0] for g in got), (what, dict(zip(self.NAMES, got, strict=False)))
        seen = [observed(p) for p in self.pools[: len(got)]]
        for name, s in zip(self.NAMES[1:], seen[1:], strict=False):
            assert s == seen[0], (what, name, first_difference(seen[0], s))

    # -- hashes -----------------------------------------------------------------------
    def hash_of(self, tokens: Sequence[int], end: int) -> bytes:
        key = tuple(tokens[:end])
        h = self._hashes.get(key)
        if h is None:
            h = self._hashes[key] = hashlib.blake2b(repr(key).encode(), digest_size=32).digest()
        return h

    def hashes_between(self, tokens: Sequence[int], have: int) -> list[bytes]:
        """The hashes of the full blocks of ``tokens`` past the first ``have`` (none without
        caching; with look-ahead hashes a block counts once L tokens follow it)."""
        if not self.config.enable_caching:
            return []
        n = max(len(tokens) - self.lag, 0) // BS
        return [self.hash_of(tokens, (i + 1) * BS) for i in range(have, n)]

    # -- requests ---------------------------------------------------------------------
    def admit_new(self) -> None:
        rnd = self.rnd
        self.serial += 1
        rid = f"r{self.serial}"
        prompt = [*rnd.choice(self.prefixes), *(rnd.randrange(50) for _ in range(rnd.randint(1, 14)))]
        prompt = prompt[: self.max_len - rnd.choice((0, 1, 5, 9))]
        kw: dict[str, Any] = {}
        if rnd.random() < 0.15:
            kw["lora"] = LoRA(rnd.choice((1, 2)), "adapter")
        if rnd.random() < 0.1:
            kw["cache_namespace"] = rnd.choice(("ns-a", "ns-b"))
        if self.v33 and rnd.random() < 0.1:
            kw["cache_salt"] = "salt"
        if rnd.random() < 0.05:
            kw["skip_reading_prefix_cache"] = True
        got = self.all("add_request", rid, prompt, self.hashes_between(prompt, 0), **kw)
        if got[0] == "ok":
            self.waiting.append(rid)

    def admit(self, rid: str) -> None:
        """A waiting (new or preempted) request's first allocation, with a lookup."""
        rnd = self.rnd
        req = self.general.requests[rid]
        look = rnd.choice((0, 0, 0, 2))
        budget = rnd.choice((req.num_tokens, req.num_tokens, rnd.randint(1, req.num_tokens)))
        way = rnd.random()
        if way < 0.08 and self.external:  # a KV connector's external tokens, caching maybe delayed
            ext = rnd.randint(1, req.num_tokens - 1) if req.num_tokens > 1 else 0
            n = req.num_tokens - ext
            delay = rnd.random() < 0.5
            got = self.all("allocate_slots", rid, n, 0, None, look, ext, delay)
            ok = got[0] == "ok" and got[1] is not None
            if ok and delay:
                self.delayed.append((rid, ext))
            n += ext
        elif way < 0.6:
            kw = {"full_sequence_must_fit": True} if self.v33 and rnd.random() < 0.3 else {}
            got = self.all("allocate_slots_with_lookup", rid, budget, look, **kw)
            ok = got[0] == "ok" and got[1].new_block_ids is not None  # type: ignore[index]
            n = got[1].num_new_tokens if ok else 0  # type: ignore[index]
        else:  # the lookup and the allocation in two calls (the hit each pool's own)
            hits = [p.get_computed_blocks(rid) for p in self.pools]
            self._same(hits, ("get_computed_blocks", rid))
            hit = hits[0]
            n = min(req.num_tokens - hit.num_tokens, budget)
            if way < 0.8 or not hit.is_empty:
                got_all = [
                    answer(p.allocate_slots, rid, n, hit.num_tokens, None if h.is_empty else h, look)
                    for p, h in zip(self.pools, hits, strict=True)
                ]
            else:  # no hit: the sliced allocation in the client's pool
                every = rnd.randint(1, 3)
                got_all = [
                    answer(drain, self.client.allocating_slots(every, rid, n, num_lookahead_tokens=look))
                ]
                got_all += [
                    answer(p.allocate_slots, rid, n, num_lookahead_tokens=look) for p in self.pools[1:]
                ]
            self.calls += 1
            self._same(got_all, ("allocate_slots", rid, n))
            ok = got_all[0][0] == "ok" and got_all[0][1] is not None
        if ok:
            self.waiting.remove(rid)
            self.running.append(rid)
            self.sched[rid] = req.num_computed_tokens + n
        elif rnd.random() < 0.5:
            self.waiting.remove(rid)
            self.all("free", rid)

    def entry(self, rid: str) -> Entry:
        """A running request's next step: usually a plain decode (or its prompt's next
        chunk), sometimes a variant the fast paths must leave to the general path, or a
        bad one every path must refuse alike."""
        rnd = self.rnd
        req = self.general.requests.get(rid)
        n_tok = req.num_tokens if req is not None else 0
        base_h = len(req.block_hashes) if req is not None else 0
        all_tokens = list(req.all_token_ids) if req is not None else []
        sched = self.sched.get(rid, n_tok)
        if sched < n_tok:  # a prompt's next chunk: no token appended
            e = Entry(rid, n_tok, base_h, sched, [], [], rnd.randint(1, n_tok - sched), rnd.choice((0, 0, 2)))
            self.kinds["chunk"] = self.kinds.get("chunk", 0) + 1
            return e
        tokens: list[Any] = [rnd.randrange(50)]
        computed: Any = sched
        num_new: Any = 1
        look: Any = 0
        kind = rnd.choices(KINDS, WEIGHTS)[0]
        if n_tok >= self.max_len - 1 and rnd.random() < 0.5:  # at max_model_len: its edges
            kind = rnd.choice(("decode", "lag", "behind", "lookahead", "spec", "huge", "ahead"))
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if kind == "spec":
            tokens += [rnd.randrange(50) for _ in range(rnd.randint(1, 3))]
            num_new = len(tokens) + rnd.randint(0, 2)
            look = rnd.choice((0, num_new - 1))
        elif kind == "lookahead":
            look = rnd.randint(1, 6)
        elif kind == "behind":
            computed = max(sched - rnd.randint(1, 9), 0)
            num_new = rnd.randint(1, sched + 1 - computed)
        elif kind == "lag":  # async scheduling: the step before's token not computed yet
            computed = max(sched - 1, 0)
        elif kind == "ahead":  # drafts counted as computed before their tokens
            computed = sched + rnd.randint(1, 3)
        elif kind == "huge":
            num_new = rnd.choice((self.max_len, self.max_len - sched, self.max_len - sched + 1))
        elif kind == "none_computed":
            computed = None
        elif kind == "nothing":
            tokens = []
        hashes: list[Any] = self.hashes_between(all_tokens + tokens, base_h)
        if kind == "odd":
            field = rnd.choice(("computed", "num_new", "look", "token"))
            value = rnd.choice(ODD_VALUES)
            if field == "computed":
                computed = value
            elif field == "num_new":
                num_new = value
            elif field == "look":
                look = value
            else:
                tokens[0] = value
        elif kind == "bad_hash" and hashes:
            hashes[0] = rnd.choice((b"", b"\x01" * 7, bytearray(hashes[0]), Bytes(hashes[0]), "h", None))
        elif kind == "no_hash":
            hashes = []
        elif kind == "extra_hash":
            hashes.append(b"\x02" * 32)
        elif kind == "unknown":
            rid = f"gone{rnd.randrange(5)}"
        return Entry(rid, n_tok + (kind == "stale"), base_h, computed, tokens, hashes, num_new, look)

    # -- one step -----------------------------------------------------------------------
    def step(self) -> None:
        """One scheduler step: admissions, every running request's entry (one by one in
        three pools, as columns in the run pool), then frees, preemptions, evictions."""
        rnd = self.rnd
        if self.v33:
            self.all("new_step_starts")
        while len(self.running) + len(self.waiting) < 7 and rnd.random() < 0.6:
            self.admit_new()
        for rid in list(self.waiting):
            if rnd.random() < 0.7:
                self.admit(rid)
        entries = [self.entry(rid) for rid in self.running]
        if entries:
            self.apply(entries)
        for rid in list(self.running):
            req = self.general.requests[rid]
            r = rnd.random()
            at_end = req.num_tokens >= self.max_len
            if r < 0.04 or (at_end and r < 0.3):
                self.running.remove(rid)
                self.all(rnd.choice(("free", "free", "free_abandoned")), rid)
            elif r < 0.06:
                self.running.remove(rid)
                self.all("preempt", rid)
                self.waiting.append(rid)
        for rid, ext in self.delayed:
            if rid in self.general.requests and rnd.random() < 0.5:
                self.all(
                    "cache_blocks", rid, rnd.choice((ext, self.general.requests[rid].num_computed_tokens))
                )
        self.delayed = [d for d in self.delayed if rnd.random() < 0.5]
        self.reserve_or_release()
        r = rnd.random()
        if r < 0.02 and self.running:
            rid = rnd.choice(self.running)
            self.all("drop_uncomputed", rid, rnd.randint(0, self.general.requests[rid].num_tokens))
        elif r < 0.05:
            self.all("evict_blocks", rnd.sample(range(1, self.config.num_blocks), rnd.randint(1, 4)))
        elif r < 0.06:
            self.all("evict_blocks", [rnd.choice((-1, True, self.config.num_blocks, 1.0))])
        elif r < 0.07 or (r < 0.09 and not self.running):
            for rid in self.running + self.waiting:
                self.all("free", rid)
            self.running, self.waiting = [], []
            self.all("reset_prefix_cache")

    def reserve_or_release(self) -> None:
        """A router's reservation of a prefix's cached blocks (held against eviction), or
        the release of one."""
        rnd = self.rnd
        r = rnd.random()
        if r < 0.1:
            self.reservations += 1
            prompt = [*rnd.choice(self.prefixes), *(rnd.randrange(50) for _ in range(rnd.randint(0, 6)))]
            self.all("reserve", f"res{self.reservations}", self.hashes_between(prompt, 0), len(prompt))
        elif r < 0.2 and self.reservations:
            self.all("release_reservation", f"res{rnd.randint(1, self.reservations)}")

    def apply(self, entries: list[Entry]) -> None:
        """The step's entries: one by one in the client's, uaa and general pools (compared
        after each), as columns in the run pool (compared after the step)."""
        answers: list[object] = []
        events: list[object] = []
        for e in entries:
            nothing = self.changes_nothing(e)
            got = [self.client_step(e), self.uaa_step(e), self.general_step(e)]
            self.calls += 1
            assert got[0] == got[1] == got[2], (e, got)
            seen = [observed(p) for p in self.pools[:3]]
            assert seen[1] == seen[0], (e, "uaa", first_difference(seen[0], seen[1]))
            assert seen[2] == seen[0], (e, "general", first_difference(seen[0], seen[2]))
            if nothing is not None and got[0][0] == "ok":  # said to change nothing: it did not
                assert got[0] == ("ok", self.general._no_new_blocks) and not seen[0][1], (e, got)
                assert _blocks(seen[0][0]) == nothing, (e, first_difference(nothing, _blocks(seen[0][0])))
            events += seen[0][1]
            answers.append(got[0])
            if got[0] == ("ok", None):
                self.answered["refused"] += 1
            if got[0][0] == "ok" and got[0][1] is not None and e.rid in self.sched:
                self.sched[e.rid] = self.general.requests[e.rid].num_computed_tokens + e.num_new
        ran = self.run_step(entries)
        assert ran == answers, (entries, ran, answers)
        run_seen, seen = observed(self.run), observed(self.client)
        assert run_seen[0] == seen[0] and run_seen[2] == seen[2], first_difference(seen[0], run_seen[0])
        assert run_seen[1] == events, (run_seen[1], events)
        for e, got in zip(entries, answers, strict=True):
            if got == ("ok", None) and e.rid in self.running and self.rnd.random() < 0.7:
                self.running.remove(e.rid)
                self.all("preempt", e.rid)
                self.waiting.append(e.rid)

    def changes_nothing(self, e: Entry) -> dict[str, object] | None:
        """The service's check of an entry a client answered as changing nothing
        (``allocation_changes_nothing``, made before the entry on the client's pool):
        when it says so, the pool's block state now (else ``None``)."""
        req = self.client.requests.get(e.rid)
        if req is None or len(e.tokens) + req.num_tokens > self.max_len:
            return None
        n = req.num_tokens + len(e.tokens)
        computed = req.num_computed_tokens if e.computed is None else e.computed
        got = answer(self.client.allocation_changes_nothing, e.rid, computed, e.num_new, e.look, n)
        if got[0] == "ok" and got[1] is True:
            self.answered["changes_nothing"] += 1
            return _blocks(export_state(self.general))
        return None

    def client_step(self, e: Entry) -> object:
        """As the predicted client (kvcoord.client.predicting.allocate_running)."""
        p = self.client
        if len(e.tokens) == 1 and len(e.hashes) <= 1:
            token, block_hash = e.tokens[0], e.hashes[0] if e.hashes else None
            if block_hash is None:
                got = p.decode_token(e.rid, e.computed, token, e.num_new, e.look)
                if got is not None:
                    self.answered["decode_token"] += 1
                    return ("ok", got)
            got = p.decode_step(e.rid, e.computed, token, block_hash, e.num_new, e.look)
            if got is not None:
                self.answered["decode_step"] += 1
                return ("ok", got)
            return answer(
                p.update_and_allocate, e.rid, e.computed, e.tokens, e.hashes, e.num_new, e.look, True
            )
        return answer(p.update_and_allocate, e.rid, e.computed, e.tokens, e.hashes, e.num_new, e.look)

    def uaa_step(self, e: Entry) -> object:
        tokens = token_list(self.rnd, e.tokens)
        return answer(self.uaa.update_and_allocate, e.rid, e.computed, tokens, e.hashes, e.num_new, e.look)

    def general_step(self, e: Entry) -> object:
        """The plain calls: the update, then the allocation (the update taken back if it raises)."""
        p = self.general
        before = p.checkpoint_request(e.rid)
        got = answer(
            p.update_request, e.rid, num_computed_tokens=e.computed, append_token_ids=e.tokens,
            append_block_hashes=e.hashes,
        )  # fmt: skip
        if got[0] != "ok":
            return got
        got = answer(p.allocate_slots, e.rid, e.num_new, 0, None, e.look)
        if got[0] != "ok":
            p.restore_request(e.rid, before)
        return got

    def run_step(self, entries: list[Entry]) -> list[object]:
        """The entries as columns, as the service's DecodeOp applies them: decode_run in
        random slices, each entry it leaves through update_and_allocate. Each entry's
        answer (an error does not stop the others here: the engine takes each alone)."""
        rnd = self.rnd
        cols = DecodeColumns(
            [e.rid for e in entries], [e.base_t for e in entries], [e.base_h for e in entries],
            [e.computed for e in entries], [e.num_new for e in entries], [e.look for e in entries],
            [len(e.tokens) for e in entries], [t for e in entries for t in e.tokens],
            [len(e.hashes) for e in entries], [h for e in entries for h in e.hashes],
        )  # fmt: skip
        if rnd.random() < 0.5 and all(type(t) is int and t >= 0 for t in cols.append_token_ids):
            cols.append_token_ids = TokenIds(cols.append_token_ids)  # as the wire reader hands them
        for name in ("base_num_tokens", "num_computed_tokens", "num_new_tokens", "num_lookahead_tokens"):
            column = getattr(cols, name)
            if rnd.random() < 0.5 and all(type(v) is int and v >= 0 for v in column):
                setattr(cols, name, Counts(column))
        pool = self.run
        n, groups = len(entries), len(pool.managers)
        counts, ids = [0] * (n * groups), []
        out: list[object] = []
        i = t = h = used = 0
        while i < n:
            stop = min(n, i + rnd.randint(1, n))
            j, t, h = pool.decode_run(cols, i, stop, t, h, counts, ids)
            for k in range(i, j):
                got = []
                for g in range(groups):
                    c = counts[k * groups + g]
                    got.append(tuple(ids[used : used + c]))
                    used += c
                out.append(("ok", tuple(got)))
            self.answered["decode_run"] += j - i
            i = j
            if i == stop:
                continue
            e = entries[i]
            got = answer(
                pool.update_and_allocate, e.rid, e.computed, list(e.tokens), e.hashes, e.num_new, e.look
            )
            out.append(got)
            if got[0] == "ok" and got[1] is not None:
                for group in got[1]:  # type: ignore[union-attr]
                    ids += group
                    used += len(group)
            t += len(e.tokens)
            h += len(e.hashes)
            i += 1
        return out


KINDS = ("decode", "spec", "lookahead", "behind", "lag", "ahead", "huge", "none_computed", "nothing", "odd",
         "bad_hash", "no_hash", "extra_hash", "unknown", "stale")  # fmt: skip
WEIGHTS = (60, 5, 5, 3, 5, 2, 2, 1, 1, 4, 2, 2, 1, 1, 1)


def _blocks(state: dict[str, Any]) -> dict[str, object]:
    """An exported state's block side (all but the requests, statistics, events and hash
    epoch, as :func:`observed` leaves them out)."""
    skip = ("requests", "prefix_cache_stats", "lookup_counters", "pending_events", "counters")
    out = {k: v for k, v in state.items() if k not in skip}
    out["counters"] = [v for i, v in enumerate(state["counters"]) if i != 1]
    return out


def run(layout: str, seed: int, steps: int) -> Diff:
    """``steps`` scheduler steps of one layout's four pools; returns them (for counts)."""
    d = Diff(layout, seed)
    for _ in range(steps):
        d.step()
    return d
