"""An undone step's free over real gRPC (``FreeOp.uncomputed_from``): the vLLM plug-in
undoes a schedule() call an outage cut short; the call's allocation, which the server
may have applied, cached the hashes of the full blocks the step was to compute, whose KV
the worker never wrote. The free that undoes it drops those cache entries (BlockRemoved
told), so no later lookup hits them; the blocks before keep theirs. So does vLLM 0.33's
drop at the take (``DropUncomputedOp``), and, in the waiting-mode client, a free or drop
of these whose Step was not applied (or may not have been): they are sent again."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from helpers import allocate, attach, hashes, new_request
from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.errors import KVCoordError, OutcomeUnknownError, RequestUnknownError, UnavailableError
from kvcoord.client.vllm033 import Remote033KVCacheManager
from kvcoord.v1 import allocator_pb2 as pb
from support import Req, wire_pool_config

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


# -- the waiting-mode client: an undone step's free or drop in a Step that failed ------------
NOT_APPLIED = UnavailableError(grpc.StatusCode.UNAVAILABLE, "injected: the Step was not applied")
UNKNOWN = OutcomeUnknownError(grpc.StatusCode.UNAVAILABLE, "injected: applied or not, unknown")
PROMPT = list(range(800, 813))  # 13 tokens: 3 full blocks of 4 cached by the allocation


def _fail_steps(m: RemoteKVCacheManager, err: KVCoordError, n: int = 1) -> None:
    """The session's next ``n`` Steps fail as a whole with ``err`` (not sent)."""
    real, left = m.sender._send, [n]

    def failing(*args: Any, **kwargs: Any) -> pb.StepResponse:
        left[0] -= 1
        if not left[0]:
            m.sender._send = real  # type: ignore[method-assign]
        raise err

    m.sender._send = failing  # type: ignore[method-assign]


def _hit(client: KVCoordClient) -> int:
    return client.find_longest_cache_hit("w", hashes(PROMPT), len(PROMPT)).hit.num_tokens


def _held(client: KVCoordClient) -> list[str]:
    return [r.request_id for r in client.inspect_pool("w", all_requests=True).requests]


def _waiting(client: KVCoordClient, profile: str = "") -> RemoteKVCacheManager:
    """The plug-in's waiting-mode manager on a new full-attention pool "w", with request
    "a" allocated (12 tokens cached: hit 12)."""
    config = wire_pool_config(64)
    config.profile = profile
    client.create_pool("w", config)
    m = (Remote033KVCacheManager if profile else RemoteKVCacheManager)(
        client, "w", hash_seed="0", renew=False
    )
    assert m.allocate_slots(Req("a", PROMPT), 13) is not None
    assert _hit(client) == 12
    return m


@pytest.mark.parametrize("err", [NOT_APPLIED, UNKNOWN], ids=["not-applied", "unknown"])
@pytest.mark.parametrize("fails", [1, 2], ids=["free-now", "free-queued"])
def test_an_undone_steps_free_in_a_failed_step_still_drops_the_entries(
    client: KVCoordClient, err: KVCoordError, fails: int
) -> None:
    """The Step carrying an undone step's free (FreeOp.uncomputed_from) fails as a whole:
    the free is sent again at once (or, when that fails too, with the next Step), still
    dropping the entries past the computed tokens (hit 4). Before, it was sent again as a
    plain Free: the request freed, its blocks' entries for KV never written kept (hit 12)."""
    m = _waiting(client)
    m.free(Req("a", PROMPT), uncomputed_from=4)
    _fail_steps(m, err, fails)
    with pytest.raises(KVCoordError):
        m.flush()
    m.flush()
    assert _held(client) == [] and _hit(client) == 4
    assert list(client.check_pool("w").violations) == []
    m.close()


@pytest.mark.parametrize("err", [NOT_APPLIED, UNKNOWN], ids=["not-applied", "unknown"])
def test_an_undone_steps_drop_at_the_take_in_a_failed_step_is_sent_again(
    client: KVCoordClient, err: KVCoordError
) -> None:
    """vLLM 0.33's deferred free of an undone step: the Step carrying the drop at the take
    (DropUncomputedOp) fails as a whole; the drop goes first in the next Step (hit 4, the
    request still held until its deferred free), and the free leaves it so. Before, the
    drop was lost: hit 12, before and after the free."""
    m = _waiting(client, "vllm-0.33")
    m.drop_uncomputed("a", 4)  # type: ignore[attr-defined]
    _fail_steps(m, err)
    with pytest.raises(KVCoordError):
        m.flush()
    m.flush()
    assert _held(client) == ["a"] and _hit(client) == 4
    m.free_all_groups_reversed("a")  # type: ignore[attr-defined]
    m.flush()
    assert _held(client) == [] and _hit(client) == 4
    m.close()


def test_an_undone_steps_drop_and_free_in_one_failed_step_go_again_together(client: KVCoordClient) -> None:
    """The drop at the take and the deferred free of the same request in one Step that
    failed as a whole: the free sent again at once drops the entries (hit 4); the drop is
    not queued after it (the request would be unknown by then, failing the next Step)."""
    m = _waiting(client, "vllm-0.33")
    m.drop_uncomputed("a", 4)  # type: ignore[attr-defined]
    m.free_all_groups_reversed("a")  # type: ignore[attr-defined]
    _fail_steps(m, NOT_APPLIED)
    with pytest.raises(UnavailableError):
        m.flush()
    assert _held(client) == [] and _hit(client) == 4
    assert not m.sender.queue
    m.close()


def test_an_undone_steps_free_or_drop_an_earlier_failure_aborted_goes_again(client: KVCoordClient) -> None:
    """A queued operation before them in the Step is refused, so the undone step's drop
    at the take and free after it are not applied (ABORTED): the drop goes with the next
    Step, the free at once, both dropping the entries (hit 4). Before, the drop was lost
    and the free sent again plain (hit 12)."""
    m = _waiting(client, "vllm-0.33")
    bad = pb.Operation(drop_uncomputed=pb.DropUncomputedOp(request_id="never-registered"))
    m.defer_op(bad)
    m.drop_uncomputed("a", 4)  # type: ignore[attr-defined]
    with pytest.raises(RequestUnknownError):
        m.flush()
    m.flush()
    assert _held(client) == ["a"] and _hit(client) == 4
    m.defer_op(bad)
    m.free(Req("a", PROMPT), uncomputed_from=4)
    with pytest.raises(RequestUnknownError):
        m.flush()
    assert _held(client) == [] and _hit(client) == 4
    m.close()


def _two_groups(client: KVCoordClient, name: str) -> RemoteKVCacheManager:
    """A waiting-mode 0.33 manager on a new pool of full attention and a sliding window
    (4-token blocks), with request "a" allocated: 4 blocks per group, every block but
    the null block (so the next allocation takes them in the order they were freed)."""
    config = wire_pool_config(9)
    config.profile = "vllm-0.33"
    config.groups.append(
        pb.KVCacheGroupSpec(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=8))
    )
    client.create_pool(name, config)
    m = Remote033KVCacheManager(client, name, hash_seed="0", renew=False)
    assert m.allocate_slots(Req("a", list(range(900, 916))), 16) is not None
    return m


def test_a_deferred_free_in_a_failed_step_goes_again_in_its_order(client: KVCoordClient) -> None:
    """vLLM 0.33's deferred free (all groups concatenated, released in one reversed
    pass: the order of the free queue, hence the block ids later allocations get) whose
    Step failed as a whole is sent again in that order: the next request gets the block
    ids it gets after the deferred free applied at once. Before, it went again as a plain
    Free (each group's blocks tail first, in group order): other ids."""
    want = _two_groups(client, "direct")
    want.free_all_groups_reversed("a")  # type: ignore[attr-defined]
    want.flush()
    ids = want.allocate_slots(Req("b", list(range(700, 716))), 16)
    m = _two_groups(client, "failed")
    m.free_all_groups_reversed("a")  # type: ignore[attr-defined]
    _fail_steps(m, NOT_APPLIED)
    with pytest.raises(UnavailableError):
        m.flush()
    got = m.allocate_slots(Req("b", list(range(700, 716))), 16)
    assert ids is not None and got is not None
    assert got.get_block_ids() == ids.get_block_ids()
    want.close()
    m.close()
