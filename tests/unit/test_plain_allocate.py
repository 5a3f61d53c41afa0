"""A plain allocation (a decode step's AllocateOp) on the pool's direct path answers,
refuses and fails exactly as the general path does, and leaves the same pool."""

from __future__ import annotations

import random

import pytest
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from kvcoord.service import operations as op
from kvcoord.service.convert import operation_from_pb
from kvcoord.service.pool_service import Fence, Limits, PoolService
from kvcoord.service.sessions import Session, SessionTable
from kvcoord.service.testing import ManualClock
from kvcoord.v1 import allocator_pb2 as pb

BS = 4
NONE = none_hash("sha256_cbor", "0")

#: (groups, num_blocks) of the random drivers' pools (here and in test_decode_op.py)
POOL_SHAPES = [
    ((FullAttentionSpec(BS),), 12),  # small: refusals
    ((FullAttentionSpec(BS),), 200),
    ((FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)), 40),  # a window leaves blocks
]


def make(groups: tuple[object, ...], num_blocks: int) -> PoolService:
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        groups=groups,
        hash_block_size=BS,
        enable_kv_cache_events=True,
        max_model_len=96,
    )  # type: ignore[arg-type]
    sessions = SessionTable(ManualClock(), 30.0, 60.0)
    return PoolService("p", cfg, ("sha256_cbor", BS, "0"), Fence("inst", 7), Limits(), sessions)


def seen(p: PoolService, outcomes: list[op.Outcome]) -> tuple[object, ...]:
    """Everything a client or a later call can tell about the pool after a Step."""
    answers = []
    for o in outcomes:
        e = o.error
        answers.append(
            (o.value, o.aborted_by, None if e is None else (e.status, e.reason, e.message, e.position))
        )
    events = p.engine.take_events()
    return (
        answers,
        p.engine.snapshot(),
        p.num_free_blocks,
        [(e.block_hashes, e.block_ids) if hasattr(e, "block_ids") else e for e in events],
        p.check().violations,
    )


class Driver:
    """One random scheduler over two pools: the same calls, the plain path on in one."""

    def __init__(self, groups: tuple[object, ...], num_blocks: int, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.pools = (make(groups, num_blocks), make(groups, num_blocks))
        self.sessions: list[tuple[Session, Session]] = []
        for _ in range(2):
            a, b = (p.attach("sha256_cbor", BS, "0", "test", 0) for p in self.pools)
            self.sessions.append((a, b))
        self.reqs: dict[str, int] = {}  # live request -> its session (0 or 1)
        self.count = 0
        self.plain_seen = 0
        self.plain_refused = 0
        self.plain_failed = 0

    def allocation(self, rid: str) -> tuple[int, op.Allocate, str]:
        """A decode-like allocation of ``rid``: usually right, sometimes wrong in one of
        the ways the general path refuses or treats otherwise."""
        who = self.reqs[rid]
        req = self.pools[1].engine.requests[rid]
        tokens = list(req.all_token_ids)
        rnd = self.rnd
        base_t, base_h = len(tokens), len(req.block_hashes)
        n_new = rnd.choice((1, 1, 1, 2, 3))
        new_tokens = [rnd.randrange(100) for _ in range(n_new)]
        new_hashes = BlockHasher("sha256_cbor", BS, NONE).extend(tokens + new_tokens)[base_h:]
        computed: int | None = base_t  # every token held is computed (a decode step)
        kind = rnd.choices(
            ("ok", "stale", "other", "nothing", "hashes", "computed_none", "too_many"), (70, 5, 5, 5, 5, 5, 5)
        )[0]
        if kind == "stale":
            base_t += 1
        elif kind == "other":
            who = 1 - who
        elif kind == "nothing":
            new_tokens, new_hashes, computed = [], [], None
        elif kind == "hashes":
            new_hashes = new_hashes + [b"x" * 32] if rnd.random() < 0.5 else []
        elif kind == "computed_none":
            computed = None
        elif kind == "too_many":
            n_new = 1000  # past max_model_len: the engine refuses the count
        sync = pb.RequestSync(
            request_id=rid,
            base_num_tokens=base_t,
            base_num_hashes=base_h,
            append_token_ids=new_tokens,
            append_block_hashes=new_hashes,
        )
        if computed is not None:
            sync.num_computed_tokens = computed
        o = operation_from_pb(pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=n_new)), 1)
        assert isinstance(o, op.Allocate)
        return who, o, kind

    def step(self) -> None:
        rnd = self.rnd
        by_session: list[list[op.Allocate | op.Free]] = [[], []]
        for rid in list(self.reqs):
            if rnd.random() < 0.08:
                who = self.reqs.pop(rid)
                by_session[who].append(op.Free(rid))
                continue
            who, o, _ = self.allocation(rid)
            by_session[who].append(o)
        while len(self.reqs) < 6:
            self.count += 1
            rid = f"r{self.count}"
            tokens = [rnd.randrange(100) for _ in range(rnd.randint(1, 14))]
            sync = op.RequestSync(
                rid, tokens, BlockHasher("sha256_cbor", BS, NONE).extend(tokens), new_request=True
            )
            who = rnd.randrange(2)
            by_session[who].append(op.Allocate(sync, len(tokens), num_new_computed_tokens=0))
            self.reqs[rid] = who
        for who in range(2):
            ops = by_session[who]
            general = [
                op.Allocate(o.sync, o.num_new_tokens) if isinstance(o, op.Allocate) and o.plain else o
                for o in ops
            ]
            self.plain_seen += sum(1 for o in ops if isinstance(o, op.Allocate) and o.plain)
            fast_out = self.pools[0].apply(self.sessions[who][0], ops)
            slow_out = self.pools[1].apply(self.sessions[who][1], general)
            assert seen(self.pools[0], fast_out) == seen(self.pools[1], slow_out)
            self.plain_refused += sum(
                1
                for o, out in zip(ops, fast_out, strict=True)
                if isinstance(o, op.Allocate) and o.plain and isinstance(out.value, op.AllocateOutcome)
                and out.value.new_block_ids is None
            )  # fmt: skip
            self.plain_failed += sum(
                1
                for o, out in zip(ops, fast_out, strict=True)
                if isinstance(o, op.Allocate) and o.plain and out.error
            )
        for rid in [r for r in self.reqs if r not in self.pools[1].engine.requests]:
            del self.reqs[rid]  # its registration failed (the pool was full)


@pytest.mark.parametrize(("groups", "num_blocks"), POOL_SHAPES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_plain_path_answers_as_the_general_one(
    groups: tuple[object, ...], num_blocks: int, seed: int
) -> None:
    d = Driver(groups, num_blocks, seed)
    for _ in range(60):
        d.step()
    assert d.plain_seen > 200  # the direct path was taken, not only the general one
    if num_blocks == 12:
        assert d.plain_refused > 0  # and refused
    assert d.plain_failed > 10  # wrong positions, sessions, hashes and counts too


def test_the_wire_reader_marks_only_plain_allocations() -> None:
    """Only an AllocateOp with its sync and num_new_tokens alone, of a registered
    request, takes the direct path."""
    sync = pb.RequestSync(request_id="a", base_num_tokens=4, append_token_ids=[1])

    def read(a: pb.AllocateOp) -> op.Allocate:
        o = operation_from_pb(pb.Operation(allocate=a), 1)
        assert isinstance(o, op.Allocate)
        return o

    assert read(pb.AllocateOp(request=sync, num_new_tokens=1)).plain
    fresh = pb.RequestSync(request_id="a", new_request=True, append_token_ids=[1])
    assert not read(pb.AllocateOp(request=fresh, num_new_tokens=1)).plain
    assert not read(pb.AllocateOp(request=sync, num_new_tokens=1, num_lookahead_tokens=2)).plain
    assert not read(pb.AllocateOp(request=sync, num_new_tokens=1, must_succeed=True)).plain
    assert not read(pb.AllocateOp(request=sync, num_new_tokens=1, lookup=True)).plain
    # the flag is a hint only: it does not make two operations differ
    assert op.Allocate(op.RequestSync("a"), 1, plain=True) == op.Allocate(op.RequestSync("a"), 1)
