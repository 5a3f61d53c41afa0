"""The lists the server bounds by max_ops_per_step that the client cannot split without
changing what they mean, and the one it can (HUNT4 lead 2; real servers, real gRPC):

* an AdmitOp's token budget is spent over its whole list, in order, and it stops after
  the first refusal: two AdmitOps of the halves (in one Step) would admit past the budget
  and after a refusal. A Step naming more requests in one AdmitOp than the server's
  max_ops_per_step is refused whole, InvalidArgumentError naming the cap: by the server
  when it is one message, by the client (the cap learned at Attach) before sending any
  piece of a Step long enough to go in pieces (old code: its first pieces applied, then
  failed as "applied in part");
* InspectPool's request_ids are read in pieces of at most that many ids and the answers
  joined (old code: refused INVALID_ARGUMENT whole)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from kvcoord.client import AsyncKVCoordClient, InvalidArgumentError, KVCoordClient, NotFoundError
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate, new_request
from support import wire_pool_config

CAP = 4


def _admit(n: int, budget: int = 1000) -> pb.Operation:
    """An AdmitOp of ``n`` new requests a0.. of 9 tokens each."""
    op = pb.Operation()
    op.admit.token_budget = budget
    for i in range(n):
        op.admit.requests.append(new_request(f"a{i}", list(range(1000 + 100 * i, 1000 + 100 * i + 9))))
    return op


def _held(c: KVCoordClient) -> list[str]:
    return sorted(r.request_id for r in c.inspect_pool("w", all_requests=True).requests)


@pytest.mark.parametrize("allocations", [0, 5])
def test_an_admit_op_longer_than_the_cap_is_refused_before_anything_is_sent(
    make_server: Callable[..., InProcessServer], allocations: int
) -> None:
    """A Step of ``allocations`` AllocateOps and then an AdmitOp of six requests, on a
    server taking four per call: refused whole, InvalidArgumentError naming the list
    and max_ops_per_step 4, the pool unchanged. In one message the server refuses it
    (nothing changed); in pieces the client does, before sending any (old code, with 5
    allocations: the first piece (four allocations) applied, the second refused,
    OutcomeUnknownError "applied in part")."""
    server = make_server("", limits=Limits(max_ops_per_step=CAP))
    with KVCoordClient(server.address, timeout=10) as c:
        c.create_pool("w", wire_pool_config(64))
        s = c.attach("w", "sha256_cbor", 4, "0")
        free = c.get_stats("w").num_free_blocks
        ops = [allocate(f"r{i}", list(range(100 * i, 100 * i + 9)), 9) for i in range(allocations)]
        with pytest.raises(InvalidArgumentError) as told:
            c.step("w", [*ops, _admit(6)], s.session_id, s.fence)
        assert type(told.value) is InvalidArgumentError, repr(told.value)
        message = told.value.message
        assert "admit.requests is 6 items long" in message and "4" in message, message
        assert "max_ops_per_step" in message and "nothing" in message, message
        assert _held(c) == [] and c.get_stats("w").num_free_blocks == free
        # at the cap it is sent, and its budget spent over the whole list as one call would
        got = c.step("w", [_admit(CAP, budget=20)], s.session_id, s.fence)
        assert [a.num_new_tokens for a in got.results[0].admit.results] == [9, 9, 2]


def _inspect_many(c: KVCoordClient, n: int) -> tuple[pb.InspectPoolResponse, pb.InspectPoolResponse]:
    s = c.attach("w", "sha256_cbor", 4, "0")
    ops = [allocate(f"r{i}", list(range(100 * i, 100 * i + 9)), 9) for i in range(n)]
    c.step("w", ops, s.session_id, s.fence)
    ids = [f"r{i}" for i in reversed(range(n))]
    every = c.inspect_pool("w", free_queue_limit=100, all_requests=True, include_cached_blocks=True)
    return c.inspect_pool("w", 100, ids, include_cached_blocks=True), every


def test_inspect_pool_of_more_ids_than_the_cap_reads_them_all(
    make_server: Callable[..., InProcessServer],
) -> None:
    """InspectPool naming ten requests on a server taking four per call answers all ten
    in the order named, with the pool's free count, free-queue head and cached blocks,
    as one read while nothing changes (old code: INVALID_ARGUMENT, "request_ids")."""
    server = make_server("", limits=Limits(max_ops_per_step=CAP))
    with KVCoordClient(server.address, timeout=10) as c:
        c.create_pool("w", wire_pool_config(64))
        got, every = _inspect_many(c, 10)
        assert [r.request_id for r in got.requests] == [f"r{i}" for i in reversed(range(10))]
        by_id = {r.request_id: r for r in every.requests}
        assert list(got.requests) == [by_id[r.request_id] for r in got.requests]
        assert got.num_free_blocks == every.num_free_blocks and got.usage == every.usage
        assert list(got.free_queue_head) == list(every.free_queue_head)
        assert list(got.cached_block_ids) == list(every.cached_block_ids)
        with pytest.raises(NotFoundError):  # an unknown id in any piece fails the read, as whole
            c.inspect_pool("w", 0, [*(f"r{i}" for i in range(9)), "nobody"])


def test_the_asyncio_client_reads_inspect_pool_in_pieces_too(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server("", limits=Limits(max_ops_per_step=CAP))

    async def main() -> tuple[list[str], str]:
        async with AsyncKVCoordClient(server.address, timeout=10) as c:
            await c.create_pool("w", wire_pool_config(64))
            s = await c.attach("w", "sha256_cbor", 4, "0")
            ops = [allocate(f"r{i}", list(range(100 * i, 100 * i + 9)), 9) for i in range(6)]
            await c.step("w", ops, s.session_id, s.fence)
            got = await c.inspect_pool("w", 0, [f"r{i}" for i in range(6)])
            try:
                await c.step("w", [_admit(5)], s.session_id, s.fence)
            except InvalidArgumentError as exc:
                told = exc.message
            else:
                told = "sent"
            return [r.request_id for r in got.requests], told

    ids, told = asyncio.run(main())
    assert ids == [f"r{i}" for i in range(6)]
    assert "5 items long" in told and "max_ops_per_step" in told, told
