"""An undone step's free over real gRPC (``FreeOp.uncomputed_from``): the vLLM plug-in
undoes a schedule() call an outage cut short; the call's allocation, which the server
may have applied, cached the hashes of the full blocks the step was to compute, whose KV
the worker never wrote. The free that undoes it drops those cache entries (BlockRemoved
told), so no later lookup hits them; the blocks before keep theirs."""

from __future__ import annotations

from helpers import allocate, attach, hashes, new_request
from kvcoord.client import KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb

TAKE = pb.Operation(take_events=pb.TakeEventsOp())


def lookup(rid: str, tokens: list[int]) -> pb.Operation:
    return pb.Operation(lookup=pb.LookupOp(request=new_request(rid, tokens)))


def test_an_undone_steps_free_drops_the_hashes_past_the_computed_tokens_over_grpc(
    client: KVCoordClient,
) -> None:
    sid, fence = attach(client)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 cached by the allocation
    h = hashes(prompt)

    def step(*ops: pb.Operation) -> list[pb.OperationResult]:
        results = list(client.step("p", list(ops), sid, fence).results)
        assert all(r.status_code == 0 for r in results), [r.status_message for r in results]
        return results

    step(allocate("a", prompt, 13), TAKE)
    # the undo: 4 tokens computed before the cut call (the step was to compute the rest)
    free = pb.Operation(free=pb.FreeOp(request_id="a", uncomputed_from=4))
    _, taken, looked_up = step(free, TAKE, lookup("b", prompt))
    removed = [list(e.block_removed.block_hashes) for e in taken.take_events.events]
    # full attention and the sliding-window group each drop blocks 2 and 3
    assert sorted(removed) == sorted([[h[1]], [h[2]]] * 2), removed
    assert looked_up.lookup.hit.num_tokens == 4  # the first block only (it was 12)
    # sent again (the outage hid the answer): the request is not held, nothing changes
    again = pb.Operation(free=pb.FreeOp(request_id="a", if_held=True, uncomputed_from=0))
    _, taken, looked_up = step(again, TAKE, lookup("c", prompt))
    assert not taken.take_events.events
    assert looked_up.lookup.hit.num_tokens == 4


def test_an_undone_steps_deferred_free_drops_the_hashes_at_the_take_over_grpc(client: KVCoordClient) -> None:
    """DropUncomputedOp (vLLM 0.33's deferred free of an undone step, at the take): the
    hashes past the token are dropped at once, the blocks stay held until the free."""
    sid, fence = attach(client)
    prompt = list(range(200, 213))
    h = hashes(prompt)

    def step(*ops: pb.Operation) -> list[pb.OperationResult]:
        results = list(client.step("p", list(ops), sid, fence).results)
        assert all(r.status_code == 0 for r in results), [r.status_message for r in results]
        return results

    step(allocate("a", prompt, 13), TAKE)
    drop = pb.Operation(drop_uncomputed=pb.DropUncomputedOp(request_id="a", uncomputed_from=4))
    _, taken, looked_up, table = step(
        drop, TAKE, lookup("b", prompt), pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="a"))
    )
    removed = [list(e.block_removed.block_hashes) for e in taken.take_events.events]
    assert sorted(removed) == sorted([[h[1]], [h[2]]] * 2), removed
    assert looked_up.lookup.hit.num_tokens == 4
    assert len(table.get_block_ids.groups[0].block_ids) == 4  # still held
    (unknown,) = client.step(
        "p", [pb.Operation(drop_uncomputed=pb.DropUncomputedOp(request_id="z"))], sid, fence
    ).results
    assert unknown.status_code != 0
