"""DecodeOp (a decode step's allocations in columns) answers, refuses and fails exactly
as the same allocations sent as AllocateOps, and leaves the same pool and events."""

from __future__ import annotations

import random

import pytest
from kvcoord.client.hashing import BlockHasher
from kvcoord.engine import FullAttentionSpec
from kvcoord.service import operations as op
from kvcoord.service.convert import operation_from_pb, outcome_to_pb
from kvcoord.service.errors import ErrorReason
from kvcoord.service.pool_service import PoolService
from kvcoord.service.session_calls import CAPABILITIES
from kvcoord.service.sessions import Session
from kvcoord.v1 import allocator_pb2 as pb
from unit.test_plain_allocate import BS, NONE, POOL_SHAPES, make


def pool_seen(p: PoolService) -> tuple[object, ...]:
    events = p.engine.take_events()
    return (
        p.engine.snapshot(),
        p.num_free_blocks,
        [(e.block_hashes, e.block_ids) if hasattr(e, "block_ids") else e for e in events],
        p.events.kept(),  # the Step's events, published to the journal
        p.events.last_sequence,
        p.engine.num_refusals,
        p.check().violations,
    )


def error(e: op.ServiceError) -> tuple[object, ...]:
    return (e.status, e.reason, e.message, e.position)


def one_by_one(outcomes: list[op.Outcome]) -> list[object]:
    """Each operation's answer as a client of AllocateOps sees it."""
    out: list[object] = []
    for o in outcomes:
        if o.aborted_by is not None:
            out.append("aborted")
        elif o.error is not None:
            out.append(error(o.error))
        elif isinstance(o.value, op.AllocateOutcome):
            new = o.value.new_block_ids
            out.append("refused" if new is None else tuple(tuple(g) for g in new))
        else:
            out.append(o.value)
    return out


def entries(d: op.DecodeOutcome, groups: int) -> list[object]:
    """A Decode's answer per entry, as the AllocateOps' would read."""
    out: list[object] = []
    ids = iter(d.new_block_ids)
    refused = set(d.refused)
    for i in range(d.num_applied):
        counts = d.num_new_blocks[i * groups : (i + 1) * groups]
        blocks = tuple(tuple(next(ids) for _ in range(c)) for c in counts)
        out.append("refused" if i in refused else blocks)
    return out


def unpacked(ops: list[object], outcomes: list[op.Outcome], groups: int) -> list[object]:
    """The answers of a Step with Decodes, per allocation (what ``one_by_one`` gives for
    the same allocations sent one by one)."""
    out: list[object] = []
    for o, res in zip(ops, outcomes, strict=True):
        if not isinstance(o, op.Decode):
            out += one_by_one([res])
            continue
        n = len(o.request_ids)
        if res.aborted_by is not None:
            out += ["aborted"] * n
        elif isinstance(res.error, op.DecodeFailed):
            done = entries(res.error.partial, groups)
            out += done + [error(res.error)] + ["aborted"] * (n - len(done) - 1)
        else:
            assert res.error is None, res.error  # a column error: none is sent here
            assert isinstance(res.value, op.DecodeOutcome)
            out += entries(res.value, groups)
    return out


def as_run(allocs: list[pb.AllocateOp]) -> op.AllocateRun:
    """The same allocations as one AllocateRunOp (each entry must succeed), read from the wire."""
    d = as_decode(allocs, True)
    r = pb.AllocateRunOp()
    for name in ("request_ids", "base_num_tokens", "base_num_hashes", "num_computed_tokens", "num_new_tokens",
                 "num_lookahead_tokens", "num_append_tokens", "append_token_ids", "num_append_hashes",
                 "append_block_hashes"):  # fmt: skip
        getattr(r, name).extend(getattr(d, name))
    o = operation_from_pb(pb.Operation.FromString(pb.Operation(allocate_run=r).SerializeToString()), 1)
    assert isinstance(o, op.AllocateRun)
    return o


def check_run(run: op.AllocateRun, res: op.Outcome, answers: list[object], groups: int) -> None:
    """An AllocateRun's outcome against its allocations' as AllocateOps (``answers``,
    read by :func:`one_by_one`): aborted alike; failed with the first failing one's
    status and reason; else the same new blocks."""
    failed = [a for a in answers if isinstance(a, tuple) and a and not isinstance(a[0], tuple)]
    if res.aborted_by is not None:
        assert set(answers) == {"aborted"}
    elif failed:
        assert res.error is not None and error(res.error)[:2] == failed[0][:2]  # type: ignore[index]
    else:
        assert res.error is None and isinstance(res.value, op.RunOutcome), res
        ids = iter(res.value.new_block_ids)
        counts = res.value.num_new_blocks
        got = [
            tuple(tuple(next(ids) for _ in range(c)) for c in counts[i * groups : (i + 1) * groups])
            for i in range(len(run.request_ids))
        ]
        assert got == answers


def as_decode(allocs: list[pb.AllocateOp], must_succeed: bool) -> op.Decode:
    d = pb.DecodeOp(must_succeed=must_succeed)
    for a in allocs:
        s = a.request
        d.request_ids.append(s.request_id)
        d.base_num_tokens.append(s.base_num_tokens)
        d.base_num_hashes.append(s.base_num_hashes)
        d.num_computed_tokens.append(s.num_computed_tokens)
        d.num_new_tokens.append(a.num_new_tokens)
        d.num_lookahead_tokens.append(a.num_lookahead_tokens)
        d.num_append_tokens.append(len(s.append_token_ids))
        d.append_token_ids.extend(s.append_token_ids)
        d.num_append_hashes.append(len(s.append_block_hashes))
        d.append_block_hashes.extend(s.append_block_hashes)
    o = operation_from_pb(pb.Operation.FromString(pb.Operation(decode=d).SerializeToString()), 1)
    assert isinstance(o, op.Decode)
    return o


class Driver:
    """One random scheduler over two pools: the same allocations, as DecodeOps in one
    and as AllocateOps in the other."""

    def __init__(self, groups: tuple[object, ...], num_blocks: int, seed: int, reserve: bool = False) -> None:
        self.rnd = random.Random(seed)
        self.reserve = reserve
        self.adopted = 0
        self.prompt = [1, 2, 3, 4, 5]
        self.groups = len(groups)
        # DecodeOps / AllocateOps / AllocateRunOps (in steps whose allocations must
        # succeed; AllocateOps in the others)
        self.pools = (make(groups, num_blocks), make(groups, num_blocks), make(groups, num_blocks))
        self.sessions: list[tuple[Session, ...]] = []
        for _ in range(2):
            self.sessions.append(tuple(p.attach("sha256_cbor", BS, "0", "test", 0) for p in self.pools))
        self.reqs: dict[str, int] = {}  # live request -> its session (0 or 1)
        self.count = 0
        self.kinds: dict[str, int] = {}
        self.refused = 0
        self.failed = 0
        self.runs = 0

    def allocation(self, rid: str, must_succeed: bool) -> tuple[int, pb.AllocateOp]:
        """A decode-like allocation of ``rid``: usually right, sometimes wrong in one of
        the ways the pool refuses or treats otherwise."""
        who = self.reqs[rid]
        req = self.pools[1].engine.requests[rid]
        tokens = list(req.all_token_ids)
        rnd = self.rnd
        base_t, base_h = len(tokens), len(req.block_hashes)
        n_new = rnd.choice((1, 1, 1, 2, 3))
        new_tokens = [rnd.randrange(100) for _ in range(n_new)]
        new_hashes = BlockHasher("sha256_cbor", BS, NONE).extend(tokens + new_tokens)[base_h:]
        look = 0
        kind = rnd.choices(
            ("ok", "stale", "stale_hashes", "other", "nothing", "hashes", "too_many", "unknown", "lookahead"),
            (70, 4, 3, 4, 4, 4, 4, 4, 6),
        )[0]
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if kind == "stale":
            base_t += 1
        elif kind == "stale_hashes":
            base_h += 1
        elif kind == "other":
            who = 1 - who
        elif kind == "nothing":
            new_tokens, new_hashes = [], []
        elif kind == "hashes":
            new_hashes = new_hashes + [b"x" * 32] if rnd.random() < 0.5 else []
        elif kind == "too_many":
            n_new = 1000  # past max_model_len: the engine refuses the count
        elif kind == "unknown":
            rid = f"gone{rnd.randrange(1000)}"
        elif kind == "lookahead":
            look = rnd.choice((1, 2, 5))
        sync = pb.RequestSync(
            request_id=rid,
            base_num_tokens=base_t,
            base_num_hashes=base_h,
            append_token_ids=new_tokens,
            append_block_hashes=new_hashes,
            num_computed_tokens=base_t,  # every token held is computed (a decode step)
        )
        a = pb.AllocateOp(
            request=sync, num_new_tokens=n_new, num_lookahead_tokens=look, must_succeed=must_succeed
        )
        return who, a

    def step(self) -> None:
        rnd = self.rnd
        must = rnd.random() < 0.2
        # per session: a list of AllocateOps (a run) or plain operations
        by_session: list[list[object]] = [[], []]
        for rid in list(self.reqs):
            if rnd.random() < 0.08:
                who = self.reqs.pop(rid)
                by_session[who].append(op.Free(rid))
                continue
            who, a = self.allocation(rid, must)
            ops = by_session[who]
            if not ops or not isinstance(ops[-1], list) or rnd.random() < 0.1:
                ops.append([])
            ops[-1].append(a)  # type: ignore[union-attr]
        live = self.pools[1].engine.reservations.live
        if self.reserve and not live and self.reqs:
            # a router's reservation of a live request's prompt: a first allocation adopts it
            req = self.pools[1].engine.requests[rnd.choice(sorted(self.reqs))]
            self.prompt = list(req.all_token_ids)
            for p in self.pools:
                p.reserve(f"res{self.count}", list(req.block_hashes), len(self.prompt), "", 1e9)
        self.adopted += len(live) < len(self.pools[0].engine.reservations.live)
        while len(self.reqs) < 6:
            self.count += 1
            rid = f"r{self.count}"
            tokens = [rnd.randrange(100) for _ in range(rnd.randint(1, 14))]
            if self.reserve and rnd.random() < 0.3:
                tokens = self.prompt[: rnd.randint(1, len(self.prompt))]
            sync = op.RequestSync(
                rid, tokens, BlockHasher("sha256_cbor", BS, NONE).extend(tokens), new_request=True
            )
            who = rnd.randrange(2)
            by_session[who].append(op.Allocate(sync, len(tokens), num_new_computed_tokens=0))
            self.reqs[rid] = who
        for who in range(2):
            columns: list[object] = []
            runs: list[object] = []
            single: list[object] = []
            for o in by_session[who]:
                if isinstance(o, list):
                    columns.append(as_decode(o, must))
                    runs.append(as_run(o))
                    single += [operation_from_pb(pb.Operation(allocate=a), 1) for a in o]
                else:
                    columns.append(o)
                    runs.append(o)
                    single.append(o)
            col_out = self.pools[0].apply(self.sessions[who][0], columns)  # type: ignore[arg-type]
            one_out = self.pools[1].apply(self.sessions[who][1], single)  # type: ignore[arg-type]
            answers = one_by_one(one_out)
            assert unpacked(columns, col_out, self.groups) == answers
            assert pool_seen(self.pools[0]) == pool_seen(self.pools[1])
            if must:
                run_out = self.pools[2].apply(self.sessions[who][2], runs)  # type: ignore[arg-type]
                k = 0
                for r, res in zip(runs, run_out, strict=True):
                    m = len(r.request_ids) if isinstance(r, op.AllocateRun) else 1
                    if isinstance(r, op.AllocateRun):
                        check_run(r, res, answers[k : k + m], self.groups)
                    else:
                        assert one_by_one([res]) == answers[k : k + m]
                    k += m
                self.runs += sum(isinstance(r, op.AllocateRun) for r in runs)
            else:
                self.pools[2].apply(self.sessions[who][2], single)  # type: ignore[arg-type]
            assert pool_seen(self.pools[2]) == pool_seen(self.pools[1])
            for c, res in zip(columns, col_out, strict=True):
                if isinstance(c, op.Decode):
                    assert outcome_to_pb(c, res).HasField("decode") == (res.aborted_by is None)
            self.refused += answers.count("refused")
            self.failed += sum(
                1 for a in answers if isinstance(a, tuple) and a and not isinstance(a[0], tuple)
            )
        for rid in [r for r in self.reqs if r not in self.pools[1].engine.requests]:
            del self.reqs[rid]  # its registration failed (the pool was full)


@pytest.mark.parametrize(("groups", "num_blocks"), POOL_SHAPES)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("reserve", [False, True])
def test_a_decode_op_answers_as_its_allocate_ops(
    groups: tuple[object, ...], num_blocks: int, seed: int, reserve: bool
) -> None:
    """Random Steps of two sessions (refusals, wrong positions, other sessions' and
    unknown requests, bad hashes and counts, look-ahead, must_succeed, reservations
    live): the same answers, pool and events; AllocateRunOps (each entry must succeed)
    too."""
    d = Driver(groups, num_blocks, seed, reserve)
    for _ in range(60):
        d.step()
    assert d.runs > 10
    assert d.failed > 10  # wrong positions, sessions, hashes, counts, unknown requests
    if num_blocks == 12:
        assert d.refused > 0


def test_a_decode_op_with_columns_of_other_lengths_changes_nothing() -> None:
    p = make((FullAttentionSpec(BS),), 20)
    s = p.attach("sha256_cbor", BS, "0", "test", 0)
    bad = op.Decode(["a"], [0], [0], [0], [1], [], [1], [5], [0], [])
    (out,) = p.apply(s, [bad])
    assert out.error is not None and "one value per entry" in out.error.message
    short = op.Decode(["a"], [0], [0], [0], [1], [0], [2], [5], [0], [])
    (out,) = p.apply(s, [short])
    assert out.error is not None and "add up" in out.error.message
    assert not isinstance(out.error, op.DecodeFailed)


def test_a_failed_entry_answers_with_its_error_and_the_entries_before_it() -> None:
    """On the wire: the failing entry's status, reason and position, and the entries
    applied before it."""
    p = make((FullAttentionSpec(BS),), 20)
    s = p.attach("sha256_cbor", BS, "0", "test", 0)
    tokens = [1, 2, 3]
    p.apply(s, [op.Allocate(op.RequestSync("a", tokens, (), new_request=True), 3)])
    d = op.Decode(["a", "b"], [3, 0], [0, 0], [3, 0], [1, 1], [0, 0], [1, 1], [4, 5], [1, 0],
                  BlockHasher("sha256_cbor", BS, NONE).extend([1, 2, 3, 4]))  # fmt: skip
    (out,) = p.apply(s, [d])
    r = outcome_to_pb(d, out)
    assert r.reason == ErrorReason.REQUEST_UNKNOWN.value
    assert r.position.request_id == "b"
    assert r.decode.num_applied == 1 and list(r.decode.num_new_blocks) == [0]  # inside its block


def test_the_server_advertises_the_decode_op() -> None:
    assert "decode_op" in CAPABILITIES
