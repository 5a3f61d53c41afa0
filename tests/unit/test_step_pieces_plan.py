"""How a large Step is cut (kvcoord.client.step_pieces), without a server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcoord.client.errors import (
    InternalError,
    KVCoordError,
    OutcomeUnknownError,
    RequestUnknownError,
    SessionExpiredError,
)
from kvcoord.client.step_pieces import (
    free_pieces,
    piece_key,
    pieces,
    send_free_pieces,
    send_free_pieces_async,
    send_in_pieces,
    send_in_pieces_async,
)
from kvcoord.v1 import allocator_pb2 as pb


def _request(sizes: list[int], key: str = "k") -> pb.StepRequest:
    return pb.StepRequest(
        pool="p", session_id="s", idempotency_key=key, fence=pb.Fence(instance_id="i", position=3),
        include_state=True, events_digest=True,
        ops=[pb.Operation(allocate=pb.AllocateOp(request=pb.RequestSync(request_id=f"r{i}",
             append_token_ids=[7] * n))) for i, n in enumerate(sizes)],
    )  # fmt: skip


def test_whole_operations_in_order_each_piece_under_the_limit_but_a_larger_one_alone() -> None:
    request = _request([100, 100, 100, 3000, 100, 100])
    limit = 1024 + 300  # (the other fields are counted as 1 KiB): two of these operations a piece
    parts = pieces(request, limit)
    assert parts is not None and len(parts) == 4
    assert [op for p in parts for op in p.ops] == list(request.ops)
    assert [p.idempotency_key for p in parts] == [f"k/{i}" for i in range(len(parts))]
    assert [len(p.ops) for p in parts] == [2, 1, 1, 2]  # the large one alone
    assert all(p.ByteSize() <= limit for p in parts if len(p.ops) > 1)
    assert parts[2].ByteSize() > limit
    assert [p.include_state for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].events_digest and not parts[0].events_digest
    assert all(p.fence == request.fence and p.pool == "p" and p.session_id == "s" for p in parts)


def test_every_piece_carries_the_calls_sequence_number() -> None:
    """The pieces of a Step and the Step that fetches the state after a failure carry
    the whole call's call_sequence (a late copy of any of them is refused)."""
    request = _request([100] * 16)
    request.call_sequence = 41
    parts = pieces(request, 1024 + 300)
    assert parts is not None and [p.call_sequence for p in parts] == [41] * len(parts)
    sent: list[pb.StepRequest] = []

    def fail_first(piece: pb.StepRequest) -> pb.StepResponse:
        sent.append(piece)
        return pb.StepResponse(results=[pb.OperationResult(status_code=3) for _ in piece.ops])

    send_in_pieces(request, parts, fail_first)
    assert [(p.idempotency_key, p.call_sequence) for p in sent] == [("k/0", 41), ("k/state", 41)]


def test_what_fits_or_cannot_be_cut_goes_in_one_message() -> None:
    assert pieces(_request([100, 100]), 1 << 20) is None
    assert pieces(_request([5000]), 400) is None
    assert pieces(_request([5000, 5000]), 0) is None


def test_a_long_key_gives_short_piece_keys() -> None:
    key = "x" * 128
    assert len(piece_key(key, "17")) <= 128 and piece_key(key, "17") != piece_key(key, "18")
    assert piece_key("abc", "state") == "abc/state"


def test_an_answer_with_the_wrong_number_of_results_is_refused() -> None:
    request = _request([100] * 20)
    parts = pieces(request, 1024 + 300)
    assert parts is not None

    def send(piece: pb.StepRequest) -> pb.StepResponse:
        return pb.StepResponse(results=[pb.OperationResult()] * (len(piece.ops) - 1))

    with pytest.raises(InternalError, match="results for"):
        send_in_pieces(request, parts, send)


def test_the_blocking_and_the_asyncio_sender_join_alike_and_name_a_failed_piece() -> None:
    """send_in_pieces and send_in_pieces_async give the same joined answer (a failed
    operation stops the pieces and the state is fetched), and a piece whose sending
    fails is named in a note by both."""
    request = _request([100] * 16)
    parts = pieces(request, 1024 + 300)
    assert parts is not None and len(parts) == 8
    sent: list[list[str]] = [[], []]

    def send(piece: pb.StepRequest, log: list[str]) -> pb.StepResponse:
        log.append(piece.idempotency_key)
        failing = piece.idempotency_key == "k/1"  # its second operation fails
        return pb.StepResponse(
            results=[
                pb.OperationResult(status_code=3 if failing and j else 0) for j in range(len(piece.ops))
            ],
            num_free_blocks=len(log),
        )

    async def send_async(piece: pb.StepRequest) -> pb.StepResponse:
        return send(piece, sent[1])

    blocking = send_in_pieces(request, parts, lambda piece: send(piece, sent[0]))
    assert asyncio.run(send_in_pieces_async(request, parts, send_async)) == blocking
    assert sent[0] == sent[1] == ["k/0", "k/1", "k/state"]
    assert len(blocking.results) == 16 and blocking.results[3].status_code == 3
    assert blocking.num_free_blocks == 3  # (the state's answer)

    def broken(piece: pb.StepRequest) -> pb.StepResponse:
        if piece.idempotency_key == "c/2":
            raise ConnectionError("lost")
        return send(piece, [])

    async def broken_async(piece: pb.StepRequest) -> pb.StepResponse:
        return broken(piece)

    clean = _request([100] * 16, key="c")
    parts = pieces(clean, 1024 + 300)
    assert parts is not None
    for run in (
        lambda: send_in_pieces(clean, parts, broken),
        lambda: asyncio.run(send_in_pieces_async(clean, parts, broken_async)),
    ):
        with pytest.raises(ConnectionError) as failed:
            run()
        assert "Step piece 3 of 8" in "".join(getattr(failed.value, "__notes__", ()))


def _refusing(key: str, exc: Exception) -> Callable[[Any], Any]:
    """A sender answering every piece (each operation applied) but the one keyed ``key``,
    which raises ``exc``."""

    def send(piece: Any) -> Any:
        if piece.idempotency_key == key:
            raise exc
        if isinstance(piece, pb.FreeRequest):
            return pb.FreeResponse(num_free_blocks=1)
        return pb.StepResponse(results=[pb.OperationResult() for _ in piece.ops])

    return send


def _notes(exc: BaseException) -> str:
    return "".join(getattr(exc, "__notes__", ()))


def _expired() -> SessionExpiredError:
    return SessionExpiredError(grpc.StatusCode.NOT_FOUND, "gone", "SESSION_EXPIRED")


def _unknown() -> RequestUnknownError:
    return RequestUnknownError(grpc.StatusCode.NOT_FOUND, "no such request", "REQUEST_UNKNOWN")


@pytest.mark.parametrize("sender", ["blocking", "asyncio"])
def test_a_failed_piece_of_a_step_or_a_free_is_told_by_one_rule(sender: str) -> None:
    """Step pieces and Free pieces follow the same rule when a piece's sending fails:
    the error gets a note naming the piece; a typed one after the first piece (something
    applied) becomes OutcomeUnknownError "applied in part", its cause the piece's error,
    unless it already tells as much (the session's end); on the first piece, or untyped,
    it is raised as it is."""

    def step(key: str, exc: Exception) -> None:
        request = _request([100] * 16, key="k")
        parts = pieces(request, 1024 + 300)
        assert parts is not None and len(parts) == 8
        send = _refusing(key, exc)
        if sender == "blocking":
            send_in_pieces(request, parts, send)
        else:

            async def send_async(piece: pb.StepRequest) -> pb.StepResponse:
                return send(piece)  # type: ignore[no-any-return]

            asyncio.run(send_in_pieces_async(request, parts, send_async))

    def free(key: str, exc: Exception) -> None:
        parts = free_pieces(
            pb.FreeRequest(pool="p", request_ids=[f"r{i}" for i in range(10)], idempotency_key="k"), 4
        )
        assert parts is not None and len(parts) == 3
        send = _refusing(key, exc)
        if sender == "blocking":
            send_free_pieces(parts, send)
        else:

            async def send_async(piece: pb.FreeRequest) -> pb.FreeResponse:
                return send(piece)  # type: ignore[no-any-return]

            asyncio.run(send_free_pieces_async(parts, send_async))

    for run, named, applied in (
        (step, "Step piece 3 of 8", "operations 0..3 of 16 were applied"),
        (free, "Free piece 2 of 3", "4 of 10 requests were freed ('r0', 'r1', 'r2', 'r3')"),
    ):
        # a typed error after the first piece: applied in part
        with pytest.raises(OutcomeUnknownError) as partly:
            run("k/2" if run is step else "k/1", _unknown())
        assert isinstance(partly.value.__cause__, RequestUnknownError)
        assert named in _notes(partly.value.__cause__)
        if run is step:  # (a Step's OutcomeUnknownError carries the note too)
            assert named in _notes(partly.value)
        assert f"{named} failed (no such request) after {applied}" in partly.value.message, (
            partly.value.message
        )
        assert "is applied in part" in partly.value.message
        # the same on the first piece (nothing applied), the session's end, an untyped one: as they are
        for key, exc, kind in (
            ("k/0", _unknown(), RequestUnknownError),
            ("k/1", _expired(), SessionExpiredError),
            ("k/1", ConnectionError("lost"), ConnectionError),
        ):
            with pytest.raises(Exception) as told:
                run(key, exc)
            assert type(told.value) is kind, (run, key, repr(told.value))
            assert told.value is exc and _notes(exc).startswith(("Step piece", "Free piece"))
            assert not isinstance(told.value, KVCoordError) or told.value.__cause__ is None
