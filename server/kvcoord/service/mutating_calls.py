"""The keyed mutating calls (Allocate, Free, Step): each read from its message, applied
to the pool and answered, a large one in slices; one :class:`~.mutations.Mutation` each
(:data:`MUTATIONS`), which :class:`~.mutations.MutationRunner` runs live (idempotency,
journal record, commit wait) and recovery replays alike."""

from __future__ import annotations

import time
from collections.abc import Generator

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import add_events, events_digest, stats_to_pb

from . import operations as op
from .convert import allocate_from_pb, allocate_to_pb, fence_to_pb, operation_from_pb, write_results
from .errors import ServiceError
from .long_syncs import allocate_in_slices, decode_in_slices, is_long, is_long_decode
from .mutations import Mutation
from .observers import OperationObserver
from .pool_service import Fence, PoolService, drain
from .sessions import Session

__all__ = [
    "ALLOCATE",
    "ANSWER_MARGIN_BYTES",
    "FREE",
    "MUTATIONS",
    "STEP",
    "allocate_answer",
    "apply_step",
    "free_answer",
    "step_answer",
    "step_slices",
    "step_weight",
]

#: what an answer keeps free besides its events or pool state (fields written after
#: the budget is taken: statistics, flags, the session id, gRPC's framing)
ANSWER_MARGIN_BYTES = 1024


# The answers of the mutating calls are built only here, from the pool's state, so
# recovery (recovery.py) rebuilds each journaled answer byte for byte from the replayed
# state: the journal keeps a digest of the answer, never the answer itself.
def allocate_answer(service: PoolService, outcome: op.Outcome, fence: pb.Fence) -> pb.AllocateResponse:
    """The answer to an applied Allocate (``outcome`` holds no error)."""
    assert isinstance(outcome.value, op.AllocateOutcome)
    return pb.AllocateResponse(
        result=allocate_to_pb(outcome.value),
        num_free_blocks=service.num_free_blocks,
        usage=service.usage,
        fence=fence,
    )


def free_answer(service: PoolService, fence: pb.Fence) -> pb.FreeResponse:
    """The answer to an applied Free."""
    return pb.FreeResponse(num_free_blocks=service.num_free_blocks, fence=fence)


def step_weight(ops: list[op.Operation]) -> tuple[int, bool]:
    """A Step's operations as the engine applies them, and whether one is a TakeEvents.

    An AllocateRun counts each entry and each check, a Decode each entry, an Admit each request it may
    admit, any other operation one: what ``kvcoord_step_operations_total`` counts, so
    that engine time per operation means the same whether a client sends a decode
    step as one run or as one AllocateOp per request."""
    n = 0
    takes_events = False
    allocate = op.Allocate
    for o in ops:
        if type(o) is allocate:  # most of a Step: one each (checked first, the cheapest test)
            n += 1
        elif isinstance(o, op.AllocateRun):
            n += len(o.request_ids) + (len(o.checks.request_ids) if o.checks is not None else 0)
        elif isinstance(o, op.Decode):
            n += len(o.request_ids)
        elif isinstance(o, op.Admit):
            n += len(o.syncs)
        else:
            n += 1
            takes_events = takes_events or isinstance(o, op.TakeEvents)
    return n, takes_events


def step_answer(
    service: PoolService,
    s: Session,
    request: pb.StepRequest,
    ops: list[op.Operation],
    outcomes: list[op.Outcome],
    fence: pb.Fence,
    max_message_bytes: int = 0,
) -> pb.StepResponse:
    """The answer to an applied Step; with ``include_state`` it takes the session's
    events and statistics (its cursor moves), as the call did. Below
    ``max_message_bytes`` (0: no bound) events past what fits are kept for the next
    call (``events_more``), never lost in a refused answer. Replay (recovery.py) builds
    the same answer under the budget the call was answered with."""
    return drain(_answer_slices(service, s, request, ops, outcomes, fence, max_message_bytes, 0))


def _answer_slices(
    service: PoolService,
    s: Session,
    request: pb.StepRequest,
    ops: list[op.Operation],
    outcomes: list[op.Outcome],
    fence: pb.Fence,
    max_message_bytes: int,
    every: int,
) -> Generator[None, None, pb.StepResponse]:
    """:func:`step_answer`, yielding after every ``every`` results written (0: never)."""
    response = pb.StepResponse(num_free_blocks=service.num_free_blocks, usage=service.usage, fence=fence)
    if every and len(ops) > every:
        for k in range(0, len(ops), every):
            write_results(response, ops[k : k + every], outcomes[k : k + every])
            yield
    else:
        write_results(response, ops, outcomes)
    if request.include_state:
        if request.events_digest or not max_message_bytes:
            taken = service.take_events(s)
        else:
            full = max_message_bytes - ANSWER_MARGIN_BYTES
            taken = service.take_events(s, full - response.ByteSize(), full)
            response.events_more = taken.more
        if request.events_digest:
            response.events_sha256 = events_digest(taken.events)
        else:
            add_events(response.events, taken.events)
        response.events_gap = taken.gap
        stats = stats_to_pb(service.make_stats(s))
        if stats is not None:
            response.prefix_cache_stats.CopyFrom(stats)
    return response


def _apply_allocate(
    service: PoolService, s: Session, request: pb.AllocateRequest, fence: Fence, max_message_bytes: int
) -> pb.AllocateResponse | ServiceError:
    return drain(_allocate_slices(service, s, request, fence, max_message_bytes, 0))


def _allocate_slices(
    service: PoolService, s: Session, request: pb.AllocateRequest, fence: Fence, max_message_bytes: int,
    every: int,
) -> Generator[None, None, pb.AllocateResponse | ServiceError]:  # fmt: skip
    """An Allocate applied, a large one's blocks taken and cached in slices (yielding
    between them: pool_allocations.py's SLICED_ALLOCATE_TOKENS) when ``every`` is not 0."""
    groups = len(service.config.groups)
    ops: list[op.Operation] = [
        (yield from allocate_in_slices(request.op, groups)) if every else allocate_from_pb(request.op, groups)
    ]
    (outcome,) = yield from service.applying(s, ops, every)
    if outcome.error is not None:
        # A refusal turned into an error (must_succeed) has still removed skipped
        # blocks, as vLLM's refusals do: the call is journaled, so recovery replays it too.
        return outcome.error
    return allocate_answer(service, outcome, fence_to_pb(fence))


def _apply_free(
    service: PoolService, s: Session, request: pb.FreeRequest, fence: Fence, max_message_bytes: int
) -> pb.FreeResponse:
    return drain(_free_slices(service, s, request, fence, max_message_bytes, 0))


def _free_slices(
    service: PoolService, s: Session, request: pb.FreeRequest, fence: Fence, max_message_bytes: int,
    every: int,
) -> Generator[None, None, pb.FreeResponse]:  # fmt: skip
    """A Free applied, yielding after every ``every`` requests freed (0: never)."""
    yield from service.freeing_requests(s, request.request_ids, request.preempt, every)
    return free_answer(service, fence_to_pb(fence))


def apply_step(
    service: PoolService, s: Session, request: pb.StepRequest, fence: Fence, max_message_bytes: int,
    observer: OperationObserver | None = None,
) -> pb.StepResponse:  # fmt: skip
    return drain(step_slices(service, s, request, fence, max_message_bytes, 0, observer))


def step_slices(
    service: PoolService, s: Session, request: pb.StepRequest, fence: Fence, max_message_bytes: int,
    every: int, observer: OperationObserver | None = None,
) -> Generator[None, None, pb.StepResponse]:  # fmt: skip
    """A Step read, applied and answered, yielding after every ``every`` operations
    read, applied or answered (0: never); the pool's engine time goes to
    ``observer`` (a live call: replay observes nothing)."""
    service.check_step_size(len(request.ops))  # before any operation is read
    groups = len(service.config.groups)
    wire = request.ops
    if every and len(wire) > every:
        ops: list[op.Operation] = []
        for k in range(0, len(wire), every):
            ops.extend([operation_from_pb(o, groups) for o in wire[k : k + every]])
            yield
    else:
        ops = []
        for o in wire:  # (a long AllocateOp's tokens, a long DecodeOp, read in slices: long_syncs.py)
            kind = o.WhichOneof("op") if every else None
            if kind == "allocate" and is_long(o.allocate):
                ops.append((yield from allocate_in_slices(o.allocate, groups)))
            elif kind == "decode" and is_long_decode(o):
                ops.append((yield from decode_in_slices(o, groups)))
            else:
                ops.append(operation_from_pb(o, groups))
    seconds = 0.0
    work = service.applying(s, ops, every)
    while True:
        t0 = time.perf_counter()
        try:
            next(work)
        except StopIteration as done:
            outcomes: list[op.Outcome] = done.value
            seconds += time.perf_counter() - t0
            break
        seconds += time.perf_counter() - t0
        yield
    response = yield from _answer_slices(
        service, s, request, ops, outcomes, fence_to_pb(fence), max_message_bytes, every
    )
    if observer is not None:  # a live call (replay observes nothing)
        weight, takes_events = step_weight(ops)
        observer.step_applied(service.name, weight, seconds)
        if response.events_gap or (
            takes_events and any(isinstance(o.value, op.EventsTaken) and o.value.gap for o in outcomes)
        ):
            observer.events_gap(service.name, "step")
    if every:  # what the Step made, dropped a slice at a time (at once: 45 ms for 65,536 operations)
        for k in range(len(ops) - every, -every, -every):
            del ops[max(k, 0) :], outcomes[max(k, 0) :]
            yield
    return response


#: the keyed mutating calls, run live and replayed alike (mutations.py)
ALLOCATE = Mutation("Allocate", pb.AllocateRequest.FromString, _apply_allocate, _allocate_slices)
FREE = Mutation("Free", pb.FreeRequest.FromString, _apply_free, _free_slices)
STEP = Mutation("Step", pb.StepRequest.FromString, apply_step, step_slices)
MUTATIONS = {m.rpc: m for m in (ALLOCATE, FREE, STEP)}
