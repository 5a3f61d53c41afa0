"""A Step larger than the client's step_piece_bytes is sent as several Steps and
answered as one (kvcoord.client.step_pieces): the same answer, pool state and
recovered journal as the one-message Step, each operation applied once whatever
happens to a piece's answer, and other pools' calls answered between the pieces
(real servers over real gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvcoord.client import AsyncKVCoordClient, KVCoordClient, KVCoordError
from kvcoord.client import _requests as rq
from kvcoord.client.errors import LocalRpcError
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import pool_toml

TOML = pool_toml("a", 600) + pool_toml("b", 16, caching=False)

#: small enough that the Steps below go in several pieces
PIECE = 2048
N = 60


def _ops(n: int = N, fail_at: int | None = None) -> list[pb.Operation]:
    """Register and allocate ``n`` requests sharing a prefix (cache hits, events), free
    every third; ``fail_at``: that operation frees a request that does not exist."""
    ops = []
    for i in range(n):
        if fail_at == i:
            ops.append(pb.Operation(free=pb.FreeOp(request_id="nobody")))
        elif i % 3 == 2:
            ops.append(pb.Operation(free=pb.FreeOp(request_id=f"r{i - 1}")))
        else:
            tokens = [1, 2, 3, 4, 5, 6, 7, 8, *range(100 + i * 8, 108 + i * 8), 9]
            ops.append(allocate(f"r{i}", tokens, len(tokens)))
    return ops


class Sizes(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Notes the serialized size of every Step sent (and runs ``before`` first)."""

    def __init__(self, before: Callable[[], None] | None = None) -> None:
        self.sizes: list[int] = []
        self.before = before

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        if details.method.endswith("/Step"):
            self.sizes.append(request.ByteSize())
            if self.before is not None:
                self.before()
        return continuation(details, request)


def _strip(answer: pb.StepResponse) -> pb.StepResponse:
    """The answer without what differs between two servers (its fence)."""
    out = pb.StepResponse()
    out.CopyFrom(answer)
    out.ClearField("fence")
    return out


def _state(c: KVCoordClient) -> pb.InspectPoolResponse:
    return c.inspect_pool("a", free_queue_limit=10_000, all_requests=True, include_cached_blocks=True)


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[Callable[[str], InProcessServer]]:
    started: list[InProcessServer] = []

    def make(name: str) -> InProcessServer:
        s = InProcessServer(TOML, data_dir=str(tmp_path / name)).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def _step(server: InProcessServer, ops: list[pb.Operation], piece: int, **kw: Any) -> tuple[Any, ...]:
    """One Step of ``ops`` with the state, through a client with ``piece``; returns the
    answer (fence stripped), the pool's state, and the Steps' sizes."""
    sizes = kw.pop("sizes", None) or Sizes()
    # unary Steps: the interceptors watch (and fault) each piece as a unary call
    with KVCoordClient(
        server.address, timeout=30, interceptors=[sizes, *kw.pop("interceptors", ())], step_stream=False
    ) as c:
        c.step_piece_bytes = piece
        s = c.attach("a", "sha256_cbor", 4, "0")
        answer = c.step("a", ops, s.session_id, s.fence, include_state=True)
        return _strip(answer), _state(c), sizes.sizes


def test_pieces_ride_the_step_stream_as_they_do_unary_calls(twins: Callable[[str], InProcessServer]) -> None:
    """A client on a server listing step_stream sends the pieces as messages of its
    Step stream: the same answer and state as one unary message."""
    one, many = twins("one"), twins("many")
    want, want_state, _ = _step(one, _ops(), 0)
    with KVCoordClient(many.address, timeout=30) as c:
        c.step_piece_bytes = PIECE
        s = c.attach("a", "sha256_cbor", 4, "0")
        got = c.step("a", _ops(), s.session_id, s.fence, include_state=True)
        assert c._carrier.opened == 1  # the pieces went on one stream
        assert _strip(got) == want and _state(c) == want_state


def test_pieces_answer_as_one_message_and_recover_the_same(
    twins: Callable[[str], InProcessServer], tmp_path: Path
) -> None:
    one, many = twins("one"), twins("many")
    want, want_state, one_sizes = _step(one, _ops(), 0)
    got, got_state, sizes = _step(many, _ops(), PIECE)
    assert len(one_sizes) == 1 and one_sizes[0] > 3 * PIECE
    assert len(sizes) > 3 and max(sizes) <= PIECE  # several messages, none over the limit
    assert got == want
    assert len(got.results) == N and got.events  # events of every piece, taken by the last
    assert got_state == want_state
    for server, name in ((one, "one"), (many, "many")):
        server.stop()
        again = InProcessServer(TOML, data_dir=str(tmp_path / name)).start()
        try:
            with KVCoordClient(again.address, timeout=30) as c:
                assert _state(c) == want_state
        finally:
            again.stop()


def test_a_failed_operation_stops_the_pieces(twins: Callable[[str], InProcessServer]) -> None:
    one, many = twins("one"), twins("many")
    fail_at = N // 2
    want, want_state, _ = _step(one, _ops(fail_at=fail_at), 0)
    got, got_state, sizes = _step(many, _ops(fail_at=fail_at), PIECE)
    assert want.results[fail_at].status_code != 0
    assert want.results[fail_at + 1].status_message == f"not applied: operation {fail_at} failed"
    assert got == want and got_state == want_state
    # the pieces after the failing one were not sent: the last Step is the state's, empty
    _, _, all_sizes = _step(twins("all"), _ops(), PIECE)
    assert 1 < len(sizes) < len(all_sizes)


@pytest.mark.parametrize("seed", [1, 3])
def test_lost_and_repeated_answers_of_pieces_apply_nothing_twice(
    twins: Callable[[str], InProcessServer], seed: int
) -> None:
    one, many = twins("one"), twins("many")
    want, want_state, _ = _step(one, _ops(), 0)
    faults = FaultInjector(seed, drop=0.3, duplicate=0.3, methods=("Step",))
    got, got_state, sizes = _step(many, _ops(), PIECE, interceptors=[faults])
    assert len(sizes) > 3 and max(sizes) <= PIECE
    assert faults.counts["dropped"] and faults.counts["duplicated"]
    assert got == want and got_state == want_state


class FailOnce(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Step number ``at`` (from 0) fails once, not sent (a non-retried status)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.steps = 0

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        if details.method.endswith("/Step"):
            self.steps += 1
            if self.steps == self.at + 1:
                raise LocalRpcError(grpc.StatusCode.INTERNAL, "injected: piece lost")
        return continuation(details, request)


def test_a_piece_that_fails_names_itself_and_the_same_request_completes_once(
    twins: Callable[[str], InProcessServer],
) -> None:
    one, many = twins("one"), twins("many")
    want, want_state, _ = _step(one, _ops(), 0)
    with KVCoordClient(many.address, timeout=30, interceptors=[FailOnce(2)], step_stream=False) as c:
        c.step_piece_bytes = PIECE
        s = c.attach("a", "sha256_cbor", 4, "0")
        request = rq.step("a", _ops(), s.session_id, s.fence, include_state=True)
        with pytest.raises(KVCoordError) as failed:
            c.send_step(request)
        assert "Step piece 3 of" in "".join(getattr(failed.value, "__notes__", ()))
        assert c.inspect_pool("a", all_requests=True).requests  # the first pieces applied
        got = c.send_step(request)  # the same request (same key): the rest, once
        assert _strip(got) == want and _state(c) == want_state


class GiveUpOnce(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Every attempt of Step number ``at`` (from 0; its retries carry its key) fails
    UNAVAILABLE, not sent, until ``healed``: its client gives up (OutcomeUnknownError)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.steps = 0
        self.key = ""
        self.healed = False

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        if details.method.endswith("/Step") and not self.healed:
            self.steps += 1
            if self.steps == self.at + 1:
                self.key = request.idempotency_key
            if request.idempotency_key == self.key:
                raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: the connection broke")
        return continuation(details, request)


def test_a_piece_given_up_on_and_the_same_request_sent_again_completes_once(
    twins: Callable[[str], InProcessServer],
) -> None:
    """A piece ends in OutcomeUnknownError (its client gives up: given_up.py names it in
    the session's next calls); the same request sent again rebuilds its pieces under the
    same keys, each naming what it named when first sent (else the first piece's body
    would differ from its kept key's: KEY_REUSED), and completes once."""
    from kvcoord.client import given_up
    from kvcoord.client.errors import OutcomeUnknownError
    from kvcoord.client.retry import RetryPolicy

    one, many = twins("one"), twins("many")
    want, want_state, _ = _step(one, _ops(), 0)
    cut = GiveUpOnce(2)
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)
    with KVCoordClient(many.address, timeout=30, retry=policy, interceptors=[cut], step_stream=False) as c:
        c.step_piece_bytes = PIECE
        s = c.attach("a", "sha256_cbor", 4, "0")
        request = rq.step("a", _ops(), s.session_id, s.fence, include_state=True)
        with pytest.raises(OutcomeUnknownError):
            c.send_step(request)
        assert list(given_up.given_up(s.session_id)) == [cut.key]
        cut.healed = True
        got = c.send_step(request)  # the same request (same key): the rest, once
        assert _strip(got) == want and _state(c) == want_state
        assert given_up.given_up(s.session_id) == {}


def test_another_pools_calls_are_answered_between_the_pieces(twins: Callable[[str], InProcessServer]) -> None:
    """Before each piece, a call on pool "b" (another client) is answered: the requests
    pool "a" holds then are counted, so the interleaving is seen without timing."""
    server = twins("one")
    seen: list[int] = []
    with KVCoordClient(server.address, timeout=30) as other:

        def call_b() -> None:
            other.get_stats("b")
            seen.append(len(other.inspect_pool("a", all_requests=True).requests))

        got, _, sizes = _step(server, _ops(), PIECE, sizes=Sizes(call_b))
    assert len(sizes) > 3
    # calls on "b" ran between the pieces, with "a" part way through the large Step
    assert seen[0] == 0 and len(set(seen)) == len(sizes) and all(0 < n for n in seen[1:])
    assert len(got.results) == N


def test_the_asyncio_client_sends_pieces_too(twins: Callable[[str], InProcessServer]) -> None:
    one, many = twins("one"), twins("many")
    want, want_state, _ = _step(one, _ops(fail_at=N // 2), 0)
    sizes: list[int] = []

    async def run() -> pb.StepResponse:
        async with AsyncKVCoordClient(many.address, timeout=30) as c:
            c.step_piece_bytes = PIECE
            call = c._call

            def counted(rpc: str, request: Any) -> Any:
                sizes.append(request.ByteSize())
                return call(rpc, request)

            c._call = counted  # type: ignore[method-assign]
            s = await c.attach("a", "sha256_cbor", 4, "0")
            return await c.step("a", _ops(fail_at=N // 2), s.session_id, s.fence, include_state=True)

    got = asyncio.run(run())
    assert len(sizes) > 2 and max(sizes) <= PIECE
    assert _strip(got) == want
    with KVCoordClient(many.address, timeout=30) as c:
        assert _state(c) == want_state


def _with_bad_id(n: int = 20) -> list[pb.Operation]:
    """``n`` allocations, then a free naming a request id past the server's bound (256
    characters): the server refuses the Step carrying it as a whole (INVALID_ARGUMENT)."""
    ops = [allocate(f"r{i}", list(range(i, i + 8)), 8) for i in range(n)]
    return [*ops, pb.Operation(free=pb.FreeOp(request_id="x" * 300))]


@pytest.mark.parametrize("stream", [False, True])
def test_a_later_piece_refused_is_told_as_applied_in_part(
    twins: Callable[[str], InProcessServer], stream: bool
) -> None:
    """One message refused as a whole changes nothing (InvalidArgumentError). In pieces,
    the earlier pieces are applied before the last one is refused: that is no "nothing
    applied" (which every other typed error of a Step means) but OutcomeUnknownError,
    its cause the piece's refusal (old code: the InvalidArgumentError itself)."""
    from kvcoord.client.errors import InvalidArgumentError, OutcomeUnknownError

    server = twins("one")
    with KVCoordClient(server.address, timeout=30, step_stream=stream) as c:
        s = c.attach("a", "sha256_cbor", 4, "0")
        with pytest.raises(InvalidArgumentError) as whole:
            c.step("a", _with_bad_id(), s.session_id, s.fence)
        assert not isinstance(whole.value, OutcomeUnknownError)
        assert list(c.inspect_pool("a", all_requests=True).requests) == []
        c.step_piece_bytes = 1300
        with pytest.raises(OutcomeUnknownError) as partly:
            c.step("a", _with_bad_id(), s.session_id, s.fence)
        assert isinstance(partly.value.__cause__, InvalidArgumentError)
        assert "applied in part" in partly.value.message
        held = {r.request_id for r in c.inspect_pool("a", all_requests=True).requests}
        assert held == {f"r{i}" for i in range(20)}


class FailState(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The state's empty Step (no operations, include_state) is refused, not sent."""

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        if details.method.endswith("/Step") and not request.ops and request.include_state:
            raise LocalRpcError(grpc.StatusCode.PERMISSION_DENIED, "injected: the state refused")
        return continuation(details, request)


def test_a_refused_state_after_a_failed_operation_is_told_as_applied_in_part(
    twins: Callable[[str], InProcessServer],
) -> None:
    """An operation fails in a middle piece; the empty Step fetching the state is then
    refused: the operations before the failed one are applied, so the caller is told
    OutcomeUnknownError, not the refusal's "nothing applied"."""
    from kvcoord.client.errors import OutcomeUnknownError, PermissionDeniedError

    server = twins("one")
    with KVCoordClient(server.address, timeout=30, interceptors=[FailState()], step_stream=False) as c:
        c.step_piece_bytes = PIECE
        s = c.attach("a", "sha256_cbor", 4, "0")
        with pytest.raises(OutcomeUnknownError) as partly:
            c.step("a", _ops(fail_at=N // 2), s.session_id, s.fence, include_state=True)
        assert isinstance(partly.value.__cause__, PermissionDeniedError)
        assert c.inspect_pool("a", all_requests=True).requests


def test_the_manager_frees_a_batch_refused_after_its_first_piece(
    twins: Callable[[str], InProcessServer],
) -> None:
    """The waiting manager batches one scheduler step's allocations, one request id past
    the server's bound, sent in pieces: the last piece is refused after the others were
    applied. Every request of the batch is reported lost (RequestsLostError) and freed on
    the server, which then holds nothing the client does not know, and a request the
    scheduler resets is allocated afresh (old code: InvalidArgumentError, read as
    "nothing applied", while the server held good0..good11: rescheduling good0 was
    "already registered")."""
    from kvcoord.client import RemoteKVCacheManager, RequestsLostError
    from support import Req

    server = twins("one")
    with KVCoordClient(server.address, timeout=30, step_piece_bytes=1300) as c:
        m = RemoteKVCacheManager(c, "a", hash_seed="0", renew=False)
        free_before = c.get_stats("a").num_free_blocks
        reqs = [Req(f"good{i}", list(range(i, i + 8))) for i in range(12)] + [Req("y" * 300, list(range(8)))]
        with m.batch() as b:
            pending = [b.allocate_slots(r, 8) for r in reqs]
        for p in pending:
            with pytest.raises(RequestsLostError):
                p.result()
        assert list(c.inspect_pool("a", all_requests=True).requests) == []
        assert c.get_stats("a").num_free_blocks == free_before
        blocks = m.allocate_slots(reqs[0], 8)
        assert blocks is not None and len(blocks.get_block_ids()[0]) == 2
        m.close()
