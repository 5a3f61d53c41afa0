"""A Step's answer and operations as the fast conversions make them: byte for byte
what the general, field-by-field conversions make."""

from __future__ import annotations

import random

import pytest
from kvcoord.engine import CacheHit
from kvcoord.service import operations as op
from kvcoord.service.bounds import check_request, check_request_slices
from kvcoord.service.convert import allocate_from_pb, operation_from_pb, write_outcome, write_results
from kvcoord.service.errors import ErrorReason, Position, ServiceError, Status
from kvcoord.service.mutation_bodies import serialized_slices
from kvcoord.service.pool_service import Limits, drain
from kvcoord.v1 import allocator_pb2 as pb


def _outcomes(rnd: random.Random, groups: int) -> list[tuple[op.Operation, op.Outcome]]:
    """Allocations of every shape (none taken, some taken, refused, stale, with a hit or
    a table) between other operations, errors and aborted ones."""
    sync = op.RequestSync("r")
    out: list[tuple[op.Operation, op.Outcome]] = []
    for _ in range(200):
        kind = rnd.randrange(9)
        n = rnd.choice((1, 1, 2, 16, 300))
        a = op.Allocate(sync, n)
        if kind <= 2:  # no block taken: the kept-bytes path
            out.append((a, op.Outcome(op.AllocateOutcome(((),) * groups, n))))
        elif kind == 3:
            ids = tuple(tuple(rnd.sample(range(1, 500), rnd.randrange(3))) for _ in range(groups))
            out.append((a, op.Outcome(op.AllocateOutcome(ids, n))))
        elif kind == 4:
            out.append((a, op.Outcome(op.AllocateOutcome(None, n, stale_hit=rnd.random() < 0.5))))
        elif kind == 5:
            hit = CacheHit(((7, 8),) * groups, 32)
            table = ((1, 2, 3),) * groups if rnd.random() < 0.5 else None
            out.append((a, op.Outcome(op.AllocateOutcome(((),) * groups, n, hit, table=table))))
        elif kind == 6:
            err = ServiceError(
                Status.PRECONDITION, "no", ErrorReason.SYNC_MISMATCH, Position("r", True, 3, 0, 3)
            )
            out.append((a, op.Outcome(error=err)))
        elif kind == 7:
            out.append((a, op.Outcome(aborted_by=rnd.randrange(5))))
        else:
            out.append((op.CommonPrefix("r"), op.Outcome([rnd.randrange(4)] * groups)))
    return out


def test_write_results_is_write_outcome_byte_for_byte() -> None:
    for seed in range(20):
        rnd = random.Random(seed)
        groups = 1 + seed % 3
        items = _outcomes(rnd, groups)
        ops = [o for o, _ in items]
        outcomes = [r for _, r in items]
        fast = pb.StepResponse(num_free_blocks=5, usage=0.5)
        write_results(fast, ops, outcomes)
        reference = pb.StepResponse(num_free_blocks=5, usage=0.5)
        for o, r in items:
            write_outcome(reference.results.add(), o, r)
        assert fast.SerializeToString() == reference.SerializeToString()
        assert len(fast.results) == len(items)


def test_a_plain_allocation_converts_as_every_field_read() -> None:
    sync = pb.RequestSync(
        request_id="r", base_num_tokens=17, base_num_hashes=1, append_token_ids=[5], num_computed_tokens=17
    )
    plain = allocate_from_pb(pb.AllocateOp(request=sync, num_new_tokens=1), 1)
    assert plain == op.Allocate(op.RequestSync("r", [5], [], False, 17, 1, 17), 1)
    # any other field set takes the general path, which reads it
    flagged = allocate_from_pb(pb.AllocateOp(request=sync, num_new_tokens=1, must_succeed=True), 1)
    assert flagged.must_succeed and flagged.sync == plain.sync
    looked = operation_from_pb(pb.Operation(allocate=pb.AllocateOp(request=sync, num_lookahead_tokens=2)), 1)
    assert isinstance(looked, op.Allocate) and looked.num_lookahead_tokens == 2 and looked.num_new_tokens == 0


def test_a_new_requests_registration_fields_are_read() -> None:
    sync = pb.RequestSync(
        request_id="r",
        new_request=True,
        append_token_ids=[1, 2],
        lora=pb.LoRA(name="a", adapter_id=3),
        skip_reading_prefix_cache=True,
        num_preemptions=2,
        cache_salt="s",
    )
    got = allocate_from_pb(pb.AllocateOp(request=sync, num_new_tokens=2), 1).sync
    assert got.new_request and got.lora is not None and got.lora.name == "a"
    assert got.skip_reading_prefix_cache and got.num_preemptions == 2 and got.cache_salt == "s"


def _request(n: int, rnd: random.Random) -> pb.StepRequest:
    ops = []
    for i in range(n):
        sync = pb.RequestSync(
            request_id=f"r{i}", append_token_ids=[rnd.randrange(1 << 20) for _ in range(rnd.randrange(5))]
        )
        ops.append(pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=rnd.randrange(1, 9))))
        if rnd.random() < 0.2:
            ops.append(pb.Operation(free=pb.FreeOp(request_id=f"f{i}")))
    return pb.StepRequest(
        pool="p",
        session_id="s",
        ops=ops,
        idempotency_key="k" * 32,
        fence=pb.Fence(instance_id="i", incarnation=3, position=9),
        include_state=rnd.random() < 0.5,
        events_digest=rnd.random() < 0.5,
    )


def test_a_step_serialized_in_slices_is_the_step_serialized_at_once() -> None:
    for seed in range(10):
        rnd = random.Random(seed)
        request = _request(rnd.randrange(1, 60), rnd)
        assert drain(serialized_slices(request, 7)) == request.SerializeToString(deterministic=True)


def test_a_step_checked_in_slices_names_the_field_check_request_names() -> None:
    limits = Limits()
    request = _request(30, random.Random(1))
    request.ops[21].allocate.request.request_id = "x" * 1000
    with pytest.raises(ServiceError) as whole:
        check_request(request, limits)
    with pytest.raises(ServiceError) as sliced:
        drain(check_request_slices(request, limits, 4))
    assert sliced.value.message == whole.value.message and sliced.value.message.startswith("ops[21].")
    request.idempotency_key = "k" * 1000  # outside the operations: checked first
    with pytest.raises(ServiceError, match="^idempotency_key"):
        drain(check_request_slices(request, limits, 4))
    request.idempotency_key = "k"
    request.ops[21].allocate.request.request_id = "ok"
    drain(check_request_slices(request, limits, 4))  # nothing past a bound
