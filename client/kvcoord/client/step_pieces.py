"""A Step too large for one message, sent as several (issue 23 item 3).

Every pool of a server shares its event loop, and a message is received and parsed
whole before any of it can be sliced: one 15 MB Step held the loop for 20+ ms in gRPC's
C code alone. The clients therefore send a Step whose serialization exceeds
``step_piece_bytes`` (:data:`DEFAULT_STEP_PIECE_BYTES`; 0 never splits) as consecutive
Steps ("pieces") of whole operations, in order, each at most that size unless one
operation alone is larger (it then goes alone). So is a Step of more operations than the
server's ``max_ops_per_step`` (``step_piece_ops``, learned at Attach), which the server
would refuse whole: each piece holds at most that many. The caller sees one StepResponse,
the one a single message gets:

* each piece carries its own idempotency key, derived from the request's (``KEY/i``),
  so sending the same request again (same key) gets the pieces already applied from
  their kept answers and applies only the rest, each once;
* only the last piece carries ``include_state`` / ``events_digest``, so the answer's
  events, statistics, free count and fence are those after every operation;
* the results are joined in order. When an operation fails, a Step applies nothing
  after it (those results are ABORTED, "not applied: operation N failed", N counted
  from the first operation of the whole request): the later pieces are not sent and
  their operations get that same result; with ``include_state`` an empty Step then
  fetches the state (key ``KEY/state``);
* when a piece's call itself fails (its retries spent), the error is raised with a
  note naming the piece and its operations: the earlier pieces are applied, nothing
  of the later ones; sending the same request again completes it exactly once. A
  typed error of a Step means "nothing applied" to its caller (the managers roll its
  requests back), which is false once a piece was sent: a failure after the first
  piece (or of the state's empty Step) is raised as OutcomeUnknownError, its cause the
  piece's own error, unless it already says as much (an unknown outcome, an evicted
  answer) or more (the session's end: everything of it is gone).

Other lists the server bounds by max_ops_per_step: a Free's request ids and an
InspectPool's are sent in pieces too (:func:`free_pieces`, :func:`inspect_pieces`); an
operation's own list (an AdmitOp's requests, an AllocateRunOp's or a DecodeOp's entries)
is not split (:func:`check_op_lists`).

Servers keep accepting a large Step in one message (from older clients), applied in
slices as before (server/kvcoord/service/wire_slices.py).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from .errors import (
    AnswerEvictedError,
    FencedError,
    InternalError,
    InvalidArgumentError,
    KVCoordError,
    LeaseExpiredError,
    OutcomeUnknownError,
    SessionExpiredError,
)

__all__ = [
    "DEFAULT_STEP_PIECE_BYTES",
    "check_op_lists",
    "free_pieces",
    "inspect_pieces",
    "joined_inspection",
    "ops_cap",
    "pieces",
    "send_free_pieces",
    "send_free_pieces_async",
    "send_in_pieces",
    "send_in_pieces_async",
]

#: a Step serialized larger than this is sent in pieces (see the module docstring)
DEFAULT_STEP_PIECE_BYTES = 1 << 20
#: the servers' bound on an idempotency key (bounds.MAX_IDEMPOTENCY_KEY_LENGTH)
_MAX_KEY = 128
_ABORTED = 10  # google.rpc.Code ABORTED
#: what a piece's fields besides its operations are counted as (pool, session, key,
#: fence, flags: usually far less)
_HEAD_BYTES = 1024
#: errors that already tell a Step's caller no less than "applied in part": an unknown
#: outcome, or the session's end (every request of it gone)
_NOT_PARTIAL = (OutcomeUnknownError, AnswerEvictedError, SessionExpiredError, FencedError, LeaseExpiredError)


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def piece_key(key: str, suffix: str) -> str:
    """The idempotency key of one piece of a Step keyed ``key`` (at most 128 characters)."""
    out = f"{key}/{suffix}"
    if len(out) > _MAX_KEY:
        out = f"{hashlib.sha256(key.encode()).hexdigest()}/{suffix}"
    return out


def ops_cap(rpc: str, response: object) -> int | None:
    """The server's max_ops_per_step an answer of ``rpc`` tells (an Attach's; 0: a server
    before the field), or ``None`` when it tells none: both clients keep it as their
    ``step_piece_ops`` however the Attach was made (a session keeper's or the caller's
    own ``client.attach``), so that no Step, Free or admission list is longer than the
    server takes."""
    if rpc != "Attach":
        return None
    return int(getattr(response, "max_ops_per_step", 0))


def free_pieces(request: pb.FreeRequest, max_ops: int) -> list[pb.FreeRequest] | None:
    """A Free naming more requests than the server's max_ops_per_step (refused whole,
    INVALID_ARGUMENT, at every attempt) as several Frees of at most that many ids, in
    order; ``None`` when it fits (or ``max_ops`` is 0). Each piece is keyed from the
    request's key (``KEY/i``, as a Step's pieces) and carries its sequence number; they
    are sent one after another (:func:`send_free_pieces`) and the last one's answer (the
    free count after them all) answers the call.

    One Free checks every id before freeing any; pieces cannot: a piece refused after an
    earlier one was applied is told as OutcomeUnknownError (:func:`noting_free_piece`).
    What can be checked here is: a request named twice is refused before any is sent.

    Raises:
        InvalidArgumentError: a request named twice (one Free is refused whole for it).
    """
    ids = list(request.request_ids)
    if not 0 < max_ops < len(ids):
        return None
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request_ids lists a request twice ({len(ids)} ids, {len(set(ids))} distinct); nothing was sent",
        )
    out = []
    for i, start in enumerate(range(0, len(ids), max_ops)):
        piece = pb.FreeRequest()
        piece.CopyFrom(request)
        del piece.request_ids[:]
        piece.request_ids.extend(ids[start : start + max_ops])
        if request.idempotency_key:
            piece.idempotency_key = piece_key(request.idempotency_key, str(i))
        out.append(piece)
    return out


#: per operation kind, its lists the server bounds by max_ops_per_step (bounds.py)
_CAPPED_LISTS = {
    "admit": ("requests",),
    "allocate_run": ("request_ids", "check_request_ids"),
    "decode": ("request_ids",),
}


def check_op_lists(index: int, op: pb.Operation, max_ops: int) -> None:
    """Refuse operation ``index`` of a Step to be sent in pieces when one of its lists is
    longer than the server's max_ops_per_step: the server would refuse its piece after
    the earlier ones were applied (the Step applied in part). An operation is not split:
    an AdmitOp spends its token budget over its whole list and stops at its first
    refusal, so two of its halves would admit past the budget or after a refusal.

    Raises:
        InvalidArgumentError: naming the list and the cap; nothing was sent.
    """
    kind = op.WhichOneof("op")
    names = _CAPPED_LISTS.get(kind or "")
    if names is None:
        return
    body = getattr(op, kind or "")
    for name in names:
        n = len(getattr(body, name))
        if n > max_ops:
            why = (
                "an AdmitOp spends its token budget over its whole list and stops at its first refusal, "
                "so it is not split; send at most that many (RemoteKVCacheManager.admit sends its "
                "waiting queue in such chunks)"
                if kind == "admit"
                else "an operation is not split"
            )
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ops[{index}].{kind}.{name} is {n} items long; the server takes at most {max_ops} "
                f"(its max_ops_per_step, told at Attach): {why}; nothing of the Step was sent",
            )


@contextlib.contextmanager
def _noting(told: Callable[[str], tuple[str, int, str]], note_partly: bool) -> Iterator[None]:
    """The one rule of a piece whose sending fails, a Step's or a Free's. ``told(message)``
    (asked on a failure only, ``message`` the error's) gives the note naming the piece,
    how many items were applied before it, and what an OutcomeUnknownError says: the
    failure gets the note; once anything was applied, a typed one is raised as that
    OutcomeUnknownError (its cause the piece's error, the note too when ``note_partly``)
    unless :data:`_NOT_PARTIAL`, since a typed error of a Step or a Free tells its caller
    that nothing was applied."""
    try:
        yield
    except Exception as exc:
        note, applied, partly = told(exc.message if isinstance(exc, KVCoordError) else "")
        exc.add_note(note)
        if applied and isinstance(exc, KVCoordError) and not isinstance(exc, _NOT_PARTIAL):
            unknown = OutcomeUnknownError(exc.code, partly)
            if note_partly:
                unknown.add_note(note)
            raise unknown from exc
        raise


def noting_free_piece(parts: list[pb.FreeRequest], i: int) -> contextlib.AbstractContextManager[None]:
    """A failure of Free piece ``i`` gets a note naming it; after the first piece, a
    typed one is raised as OutcomeUnknownError (:func:`_noting`): the requests of the
    earlier pieces are freed, and a typed error of a Free tells its caller none was."""

    def told(message: str) -> tuple[str, int, str]:
        first = sum(len(p.request_ids) for p in parts[:i])
        total = sum(len(p.request_ids) for p in parts)
        what = f"Free piece {i + 1} of {len(parts)}"
        freed = [rid for p in parts[:i] for rid in p.request_ids]
        shown = ", ".join(repr(r) for r in freed[:8]) + (", ..." if len(freed) > 8 else "")
        note = (
            f"{what} (ids {first}..{first + len(parts[i].request_ids) - 1} of {total}) failed: the earlier "
            "pieces are applied, none after it was sent"
        )
        partly = (
            f"{what} failed ({message}) after {first} of {total} requests were freed ({shown}): the "
            "Free is applied in part; treat every request it named as freed or lost"
        )
        return note, first, partly

    return _noting(told, note_partly=False)


def send_free_pieces(
    parts: list[pb.FreeRequest], send: Callable[[pb.FreeRequest], pb.FreeResponse]
) -> pb.FreeResponse:
    """Send :func:`free_pieces` in order through ``send``; the last answer."""
    answer = None
    for i, piece in enumerate(parts):
        with noting_free_piece(parts, i):
            answer = send(piece)
    assert answer is not None
    return answer


async def send_free_pieces_async(
    parts: list[pb.FreeRequest], send: Callable[[pb.FreeRequest], Awaitable[pb.FreeResponse]]
) -> pb.FreeResponse:
    """:func:`send_free_pieces` for the asyncio client."""
    answer = None
    for i, piece in enumerate(parts):
        with noting_free_piece(parts, i):
            answer = await send(piece)
    assert answer is not None
    return answer


def inspect_pieces(request: pb.InspectPoolRequest, max_ops: int) -> list[pb.InspectPoolRequest] | None:
    """An InspectPool naming more requests than the server's max_ops_per_step (refused
    whole, INVALID_ARGUMENT) as several of at most that many ids, in order; ``None``
    when it fits (or ``max_ops`` is 0, or it asks for every request). Only the last
    piece asks for the free-queue head and the cached blocks. The pieces are separate
    reads: the pool may change between them (each block table is as it was when its
    piece was read; the pool-wide fields are the last piece's). :func:`joined_inspection`
    joins their answers."""
    ids = list(request.request_ids)
    if request.all_requests or not 0 < max_ops < len(ids):
        return None
    out = []
    for start in range(0, len(ids), max_ops):
        piece = pb.InspectPoolRequest(pool=request.pool, request_ids=ids[start : start + max_ops])
        out.append(piece)
    out[-1].free_queue_limit = request.free_queue_limit
    out[-1].include_cached_blocks = request.include_cached_blocks
    return out


def joined_inspection(answers: list[pb.InspectPoolResponse]) -> pb.InspectPoolResponse:
    """The answers of :func:`inspect_pieces`' pieces as one: every piece's block tables
    in order, the rest the last piece's."""
    out = pb.InspectPoolResponse()
    out.CopyFrom(answers[-1])
    del out.requests[:]
    for answer in answers:
        out.requests.extend(answer.requests)
    return out


def pieces(request: pb.StepRequest, limit: int, max_ops: int = 0) -> list[pb.StepRequest] | None:
    """``request`` cut into Steps of whole operations of at most ``limit`` serialized
    bytes each (an operation larger than that alone) and at most ``max_ops`` operations
    (the server's max_ops_per_step), keyed from its key; ``None`` when it fits in one
    message (or both are 0, or it has fewer than two operations). One whose operation
    holds a list longer than ``max_ops`` is refused before anything is sent
    (:func:`check_op_lists`; in one message the server refuses it whole)."""
    ops = request.ops
    too_many = 0 < max_ops < len(ops)
    if len(ops) < 2 or not (too_many or (limit > 0 and request.ByteSize() > limit)):
        return None
    # the cuts depend on the operations alone (a request sent again with another fence
    # is cut the same way): the other fields are counted as at most _HEAD_BYTES
    groups: list[list[pb.Operation]] = []
    group: list[pb.Operation] = []
    size = _HEAD_BYTES
    for index, op in enumerate(ops):
        if max_ops:
            check_op_lists(index, op, max_ops)
        n = op.ByteSize()
        n += 1 + _varint_len(n)
        if group and ((limit > 0 and size + n > limit) or len(group) == max_ops):
            groups.append(group)
            group, size = [], _HEAD_BYTES
        group.append(op)
        size += n
    groups.append(group)
    out = [
        _same_call(request, idempotency_key=piece_key(request.idempotency_key, str(i)), ops=group)
        for i, group in enumerate(groups)
    ]
    last = out[-1]
    last.include_state = request.include_state
    last.events_digest = request.events_digest
    return out


def _same_call(request: pb.StepRequest, **fields: Any) -> pb.StepRequest:
    """A Step of the same call as ``request`` (its pool, session, fence and call
    sequence: a late copy of any piece is refused as the whole call's) with ``fields``
    (a piece's key and operations, or the state's empty Step's)."""
    return pb.StepRequest(
        pool=request.pool,
        session_id=request.session_id,
        fence=request.fence if request.HasField("fence") else None,
        call_sequence=request.call_sequence,
        **fields,
    )


class _Joiner:
    """The pieces' answers joined into the answer of the whole request."""

    def __init__(self, request: pb.StepRequest, parts: list[pb.StepRequest]) -> None:
        self.request = request
        self.parts = parts
        self.total = len(request.ops)
        self.answer = pb.StepResponse()
        self.last: pb.StepResponse | None = None
        #: the index (in the whole request) of the operation that failed
        self.failed: int | None = None

    def add(self, i: int, answer: pb.StepResponse) -> bool:
        """Take piece ``i``'s answer; False once an operation failed (send no more)."""
        if len(answer.results) != len(self.parts[i].ops):
            raise InternalError(
                grpc.StatusCode.INTERNAL,
                f"Step piece {i + 1} of {len(self.parts)} got {len(answer.results)} results for "
                f"{len(self.parts[i].ops)} operations: the joined answer would be wrong",
            )
        offset = len(self.answer.results)
        results = self.answer.results
        for j, r in enumerate(answer.results):
            if self.failed is None:
                results.append(r)
                if r.status_code:
                    self.failed = offset + j
            else:
                results.add(status_code=_ABORTED, status_message=self._aborted())
        self.last = answer
        return self.failed is None

    def _aborted(self) -> str:
        return f"not applied: operation {self.failed} failed"

    def state_request(self) -> pb.StepRequest:
        """The empty Step that fetches the state after a failure stopped the pieces."""
        request = self.request
        return _same_call(
            request,
            idempotency_key=piece_key(request.idempotency_key, "state"),
            include_state=True,
            events_digest=request.events_digest,
        )

    def finish(self, state: pb.StepResponse | None) -> pb.StepResponse:
        results = self.answer.results
        for _ in range(len(results), self.total):
            results.add(status_code=_ABORTED, status_message=self._aborted())
        rest = state if state is not None else self.last
        assert rest is not None
        rest.ClearField("results")
        self.answer.MergeFrom(rest)
        return self.answer

    def noting(self, i: int) -> contextlib.AbstractContextManager[None]:
        """A failure while sending message ``i`` (``len(parts)``: the state's empty
        Step) gets a note naming its piece; after the first piece, a typed one is
        raised as OutcomeUnknownError (module docstring; :func:`_noting`)."""

        def told(message: str) -> tuple[str, int, str]:
            # applied before message i: every operation of the earlier pieces, or (the
            # state's Step) those before the one that failed
            if i == len(self.parts):
                what, applied = "the Step's state", self.failed or 0
                note = f"the Step's state, after operation {self.failed} failed, was not fetched"
            else:
                applied = sum(len(p.ops) for p in self.parts[:i])
                what = f"Step piece {i + 1} of {len(self.parts)}"
                note = (
                    f"{what} (operations {applied}..{applied + len(self.parts[i].ops) - 1} of {self.total}) "
                    "failed: the earlier pieces are applied, none after it was sent; sending the same "
                    "request again (same idempotency key) applies the rest once"
                )
            partly = (
                f"{what} failed ({message}) after operations 0..{applied - 1} of {self.total} were "
                "applied: the Step is applied in part; treat every request it named as changed (the "
                "managers report them lost and free them)"
            )
            return note, applied, partly

        return _noting(told, note_partly=True)

    def wants_state(self) -> bool:
        """Whether a failure stopped the pieces before the last, which was to carry the
        state: an empty Step then fetches it (:meth:`state_request`)."""
        return len(self.answer.results) < self.total and self.request.include_state


# The two senders below take the same steps, one blocking and one awaiting: each piece
# in order until an operation fails, then the state if the request asked for it.


def send_in_pieces(
    request: pb.StepRequest, parts: list[pb.StepRequest], send: Callable[[pb.StepRequest], pb.StepResponse]
) -> pb.StepResponse:
    """Send ``parts`` (:func:`pieces` of ``request``) in order through ``send`` and join
    their answers (module docstring)."""
    joiner = _Joiner(request, parts)
    for i, piece in enumerate(parts):
        with joiner.noting(i):
            answer = send(piece)
        if not joiner.add(i, answer):
            break
    state = None
    if joiner.wants_state():
        with joiner.noting(len(parts)):
            state = send(joiner.state_request())
    return joiner.finish(state)


async def send_in_pieces_async(
    request: pb.StepRequest,
    parts: list[pb.StepRequest],
    send: Callable[[pb.StepRequest], Awaitable[pb.StepResponse]],
) -> pb.StepResponse:
    """:func:`send_in_pieces` for the asyncio client."""
    joiner = _Joiner(request, parts)
    for i, piece in enumerate(parts):
        with joiner.noting(i):
            answer = await send(piece)
        if not joiner.add(i, answer):
            break
    state = None
    if joiner.wants_state():
        with joiner.noting(len(parts)):
            state = await send(joiner.state_request())
    return joiner.finish(state)
