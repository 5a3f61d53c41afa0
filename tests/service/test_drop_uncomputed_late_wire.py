"""A late or duplicated ``DropUncomputedOp`` over real gRPC (vLLM 0.33's deferred free of
an undone step, at the take: the cache entries of a request's blocks past a token are
dropped, the blocks stay held until the free).

The op names only a request id and a token: no positioned sync guards it. What keeps a
copy of it from dropping cache entries it was not sent for is (1) the Step's
idempotency key: the same Step delivered again, at once or late, is answered from
memory and never applied a second time, and (2) the request's ownership check: sent
again in a later Step (a new key) after the request was freed, it is refused with
NOT_FOUND (REQUEST_UNKNOWN), the Step's later operations are not applied (ABORTED) and
the pool is left as it was, whoever holds the blocks the request held by then. (A copy
delivered after the server's idempotency window, which no client sends: it retries
for half of it, meets only the ownership check.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from helpers import allocate, attach, follow_up, hashes, new_request
from kvcoord.client import KVCoordClient
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import pool_toml

TAKE = pb.Operation(take_events=pb.TakeEventsOp())
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
ABORTED = grpc.StatusCode.ABORTED.value[0]


def lookup(rid: str, tokens: list[int]) -> pb.Operation:
    return pb.Operation(lookup=pb.LookupOp(request=new_request(rid, tokens)))


def drop(rid: str, uncomputed_from: int) -> pb.Operation:
    return pb.Operation(drop_uncomputed=pb.DropUncomputedOp(request_id=rid, uncomputed_from=uncomputed_from))


def table(rid: str) -> pb.Operation:
    return pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id=rid))


def removed(result: pb.OperationResult) -> list[bytes]:
    """The hashes the BlockRemoved events of a TakeEvents result name, sorted."""
    return sorted(
        x
        for e in result.take_events.events
        if e.HasField("block_removed")
        for x in e.block_removed.block_hashes
    )


def _stepper(c: KVCoordClient, sid: str, fence: pb.Fence) -> Callable[..., list[pb.OperationResult]]:
    def step(*ops: pb.Operation) -> list[pb.OperationResult]:
        results = list(c.step("p", list(ops), sid, fence).results)
        assert all(r.status_code == 0 for r in results), [r.status_message for r in results]
        return results

    return step


@contextmanager
def _faulty_session(
    address: str, faults: FaultInjector
) -> Iterator[tuple[KVCoordClient, str, pb.Fence, Callable[..., list[pb.OperationResult]]]]:
    """A client whose Steps pass ``faults`` (off until enabled), attached to pool "p":
    the client, its session id and fence, and a stepper that checks every result."""
    faults.enabled = False
    with KVCoordClient(address, timeout=10, interceptors=[faults]) as c:
        sid, fence = attach(c)
        yield c, sid, fence, _stepper(c, sid, fence)


def _cached(c: KVCoordClient) -> list[int]:
    return sorted(c.inspect_pool("p", include_cached_blocks=True).cached_block_ids)


def test_a_duplicated_drop_uncomputed_step_is_answered_once_and_applied_once(server: InProcessServer) -> None:
    """The Step carrying the drop reaches the server twice at once, with the same
    idempotency key (a duplicate): the second copy is answered with the first answer
    (the drop's BlockRemoved events, b allocated) and changes nothing. Applied again,
    its allocation of "b" would be refused (b exists) and its TakeEvents would hold
    b's own events, not the drop's."""
    faults = FaultInjector(0, duplicate=1.0, methods=("Step",))
    with _faulty_session(server.address, faults) as (_, _, _, step):
        prompt, other = list(range(300, 313)), list(range(400, 413))
        h = hashes(prompt)
        step(allocate("a", prompt, 13), TAKE)  # 3 full blocks cached, per group
        faults.enabled = True
        answer = step(drop("a", 4), TAKE, allocate("b", other, 13))
        faults.enabled = False
        assert faults.counts["duplicated"] == 1
        assert removed(answer[1]) == sorted([h[1], h[2]] * 2)  # (two groups)
        assert not answer[2].allocate.refused and answer[2].allocate.new_block_ids
        taken, hit = step(TAKE, lookup("x", prompt))
        assert not removed(taken)  # nothing dropped a second time
        assert hit.lookup.hit.num_tokens == 4


def test_a_late_copy_of_a_drop_uncomputed_step_leaves_the_entries_computed_since(
    server: InProcessServer,
) -> None:
    """The Step carrying the drop is delivered again late, with the same idempotency
    key, after its request was preempted and computed its blocks again (the entries
    they cache now are valid, for the same hashes): the copy is answered from memory,
    not applied. Applied again, it would drop the request's valid entries (a lookup of
    its prompt would hit 4 tokens, not 12): the op carries no positioned sync, and the
    request still exists."""
    late = FaultInjector(0, reorder=1.0, methods=("Step",))
    with _faulty_session(server.address, late) as (_, _, _, step):
        prompt = list(range(300, 313))
        step(allocate("a", prompt, 13), TAKE)
        late.enabled = True
        step(drop("a", 4), TAKE)  # applied, and held for a late copy
        late.enabled = False
        # preempted, then computed again (an atomic lookup hits its first block)
        step(pb.Operation(preempt=pb.PreemptOp(request_id="a")), TAKE)
        again = pb.AllocateOp(
            request=follow_up("a", prompt, num_computed_tokens=0), num_new_tokens=13, lookup=True
        )
        step(pb.Operation(allocate=again), TAKE)
        late.enabled = True  # the held copy of the drop's Step is delivered before this one
        taken, hit = step(TAKE, lookup("y", prompt))
        late.enabled = False
        assert late.counts["reordered"] == 1
        assert not removed(taken)
        assert hit.lookup.hit.num_tokens == 12  # a's valid entries: all 3 full blocks


def test_a_drop_uncomputed_sent_again_after_the_free_is_refused_and_changes_nothing(
    client: KVCoordClient,
) -> None:
    """The op sent again in a later Step (a new key) after its request was freed: the
    drop is NOT_FOUND (REQUEST_UNKNOWN, the server's position: not held), the Step's
    earlier operation stays applied, its later ones are not applied (ABORTED: no event
    taken, "c" not registered), and the pool is as before: the same cached blocks, free
    count and hit."""
    sid, fence = attach(client)
    step = _stepper(client, sid, fence)
    prompt = list(range(500, 513))
    step(allocate("a", prompt, 13), TAKE)
    step(drop("a", 4), pb.Operation(free=pb.FreeOp(request_id="a")), TAKE)
    before = (_cached(client), client.get_stats("p").num_free_blocks)
    hit_before = step(lookup("x", prompt))[0].lookup.hit.num_tokens
    assert hit_before == 4

    response = client.step(
        "p", [lookup("y", prompt), drop("a", 0), TAKE, allocate("c", prompt, 13)], sid, fence
    )
    first, refused, *rest = response.results
    assert first.status_code == 0 and first.lookup.hit.num_tokens == 4
    assert refused.status_code == NOT_FOUND, refused.status_message
    assert pb.ErrorReason.Name(refused.reason) == "REQUEST_UNKNOWN"
    assert refused.position.request_id == "a" and not refused.position.exists
    assert [r.status_code for r in rest] == [ABORTED, ABORTED]

    assert (_cached(client), client.get_stats("p").num_free_blocks) == before
    taken, hit = step(TAKE, lookup("z", prompt))
    assert not taken.take_events.events  # nothing dropped, nothing stored (c never allocated)
    assert hit.lookup.hit.num_tokens == hit_before
    assert "c" not in [r.request_id for r in client.inspect_pool("p", all_requests=True).requests]


def test_a_late_drop_uncomputed_leaves_the_entries_of_the_request_now_holding_its_blocks(
    make_server: Callable[..., InProcessServer],
) -> None:
    """In a pool of 4 blocks, "a" is dropped past its first block and freed; "b" then
    gets the very blocks "a" held and caches its own 3 full blocks on them. The drop's
    Step delivered again late (same key: answered from memory) and the op sent again in
    a new Step (refused: "a" is unknown) remove none of b's entries: b's table is the
    same, no BlockRemoved is told, a lookup of b's prompt still hits 12 tokens."""
    server = make_server(pool_toml("p", 5))  # block 0 is the null block: 4 to allocate
    late = FaultInjector(0, reorder=1.0, methods=("Step",))
    with _faulty_session(server.address, late) as (c, sid, fence, step):
        prompt, other = list(range(600, 613)), list(range(700, 713))
        h = hashes(prompt)
        (alloc_a, _) = step(allocate("a", prompt, 13), TAKE)
        a_blocks = list(alloc_a.allocate.new_block_ids[0].block_ids)
        late.enabled = True
        (_, taken) = step(drop("a", 4), TAKE)  # applied, and held for a late copy
        late.enabled = False
        assert removed(taken) == sorted([h[1], h[2]])
        step(pb.Operation(free=pb.FreeOp(request_id="a")), TAKE)
        (alloc_b, _) = step(allocate("b", other, 13), TAKE)
        b_blocks = list(alloc_b.allocate.new_block_ids[0].block_ids)
        assert sorted(b_blocks) == sorted(a_blocks)  # the blocks a held are b's now
        cached = _cached(c)

        late.enabled = True  # the drop's Step (same key) is delivered again before this one
        taken, hit, b_table = step(TAKE, lookup("x", other), table("b"))
        late.enabled = False
        assert late.counts["reordered"] == 1
        assert not taken.take_events.events
        assert hit.lookup.hit.num_tokens == 12
        assert list(b_table.get_block_ids.groups[0].block_ids) == b_blocks

        (refused,) = c.step("p", [drop("a", 0)], sid, fence).results  # a new key
        assert refused.status_code == NOT_FOUND and pb.ErrorReason.Name(refused.reason) == "REQUEST_UNKNOWN"
        taken, hit, b_table = step(TAKE, lookup("y", other), table("b"))
        assert not taken.take_events.events
        assert hit.lookup.hit.num_tokens == 12
        assert list(b_table.get_block_ids.groups[0].block_ids) == b_blocks
        assert _cached(c) == cached
