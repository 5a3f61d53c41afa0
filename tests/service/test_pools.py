"""Pool lifecycle, the hash handshake and every error code, over real gRPC."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import POOL_TOML
from helpers import allocate, attach, follow_up, hashes, new_request
from kvcoord.client import (
    AlreadyExistsError,
    FailedPreconditionError,
    HashMismatchError,
    InvalidArgumentError,
    KVCoordClient,
    NotFoundError,
    PermissionDeniedError,
    RequestUnknownError,
    ResourceExhaustedError,
    SessionExpiredError,
    SyncMismatchError,
)
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb


def full_pool(num_blocks: int = 32) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
        hash_block_size=4,
        enable_caching=True,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )


def state(client: KVCoordClient, pool: str = "p") -> tuple[object, ...]:
    """Everything observable from outside: free queue, usage, stats, block tables."""
    s = client.get_stats(pool)
    s.ClearField("limits")  # server-wide: the idempotency store counts every keyed call
    i = client.inspect_pool(pool, free_queue_limit=1000)
    return (s.SerializeToString(), tuple(i.free_queue_head), i.usage)


def test_create_get_list_delete(client: KVCoordClient) -> None:
    """A created pool is listed and described; identical re-creation is a no-op; delete removes it."""
    first = client.create_pool("q", full_pool())
    assert first.created and first.pool.coordinator == "unitary" and first.pool.num_free_blocks == 31
    again = client.create_pool("q", full_pool())
    assert not again.created
    assert [p.name for p in client.list_pools().pools] == ["p", "q"]
    assert client.get_pool("p").pool.coordinator == "hybrid"
    client.delete_pool("q")
    with pytest.raises(NotFoundError, match="'q' does not exist"):
        client.get_pool("q")


def test_same_name_other_config_already_exists(client: KVCoordClient) -> None:
    """ALREADY_EXISTS names the pool; the existing pool is untouched."""
    client.create_pool("q", full_pool())
    with pytest.raises(AlreadyExistsError, match="'q' already exists with a different configuration"):
        client.create_pool("q", full_pool(48))
    assert client.get_pool("q").pool.config.num_blocks == 32


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.groups[0].full.__setattr__("block_size", 8), "hash_block_size == block_size"),
        (lambda c: c.__setattr__("hash_algo", "md5"), "hash_algo must be one of"),
        (lambda c: c.__setattr__("hash_seed", ""), "hash_seed is required"),
        (lambda c: c.__setattr__("num_blocks", 0), "num_blocks must be a positive integer"),
        (lambda c: c.groups.add(), "groups\\[1\\] has no spec"),
    ],
)
def test_invalid_config_names_the_rule(
    client: KVCoordClient, mutate: Callable[[pb.PoolConfig], object], message: str
) -> None:
    """An invalid layout is INVALID_ARGUMENT with the failed rule in the message, and no pool."""
    cfg = full_pool()
    mutate(cfg)
    with pytest.raises(InvalidArgumentError, match=message):
        client.create_pool("bad", cfg)
    assert [p.name for p in client.list_pools().pools] == ["p"]


def test_bad_pool_name(client: KVCoordClient) -> None:
    with pytest.raises(InvalidArgumentError, match="pool name"):
        client.create_pool("no spaces", full_pool())


def test_hash_handshake(client: KVCoordClient) -> None:
    """Attach succeeds with the pool's settings and names every difference otherwise."""
    ok = client.attach("p", "sha256_cbor", 4, "0", client_name="w1")
    assert ok.session_id and ok.lease_seconds == 30
    with pytest.raises(HashMismatchError) as err:
        client.attach("p", "sha256", 16, "1")
    msg = err.value.message
    assert "hash_algo is 'sha256_cbor' but the client uses 'sha256'" in msg
    assert "hash_block_size is 4 but the client uses 16" in msg
    assert "hash_seed is '0' but the client uses '1'" in msg
    assert isinstance(err.value, FailedPreconditionError)


def test_not_found_codes(client: KVCoordClient) -> None:
    """Unknown pool, request and session are NOT_FOUND with the name in the message
    (and the reason: REQUEST_UNKNOWN, SESSION_EXPIRED)."""
    with pytest.raises(NotFoundError, match="pool 'nope'"):
        client.get_stats("nope")
    sid, fence = attach(client)
    r = client.step("p", [pb.Operation(free=pb.FreeOp(request_id="ghost"))], sid, fence)
    assert r.results[0].status_code == 5 and "'ghost' is not in pool 'p'" in r.results[0].status_message
    assert r.results[0].reason == pb.REQUEST_UNKNOWN
    with pytest.raises(SessionExpiredError, match="'deadbeef' is unknown"):
        client.heartbeat("deadbeef")
    with pytest.raises(RequestUnknownError, match="'ghost' is not in pool 'p'"):
        client.free("p", ["ghost"], session_id=sid, fence=fence)
    # a sync naming a request that does not exist: NOT_FOUND too, with its position
    r = client.step("p", [allocate("ghost", None, 4)], sid, fence)
    assert r.results[0].status_code == 5 and r.results[0].reason == pb.REQUEST_UNKNOWN
    assert r.results[0].position.request_id == "ghost" and not r.results[0].position.exists


def test_invalid_argument_changes_nothing(client: KVCoordClient) -> None:
    """Bad counts or hashes are INVALID_ARGUMENT and the pool is exactly as before."""
    sid, fence = attach(client)
    client.allocate("p", allocate("a", list(range(10)), 10).allocate, sid, fence)
    before = state(client)
    bad = pb.AllocateOp(
        request=pb.RequestSync(request_id="b", append_token_ids=list(range(8)), new_request=True),
        num_new_tokens=8,
    )
    with pytest.raises(InvalidArgumentError, match="expected 2 new block hashes"):
        client.allocate("p", bad, sid, fence)
    with pytest.raises(InvalidArgumentError, match="exceed max_model_len 256"):
        client.allocate("p", allocate("c", list(range(10)), 300).allocate, sid, fence)
    with pytest.raises(InvalidArgumentError, match="num_new_tokens must be > 0"):
        client.allocate("p", allocate("d", list(range(10)), 0).allocate, sid, fence)
    # a follow-up sync of "a" with bad hashes or a bad count leaves "a" as it was
    bad_a = pb.AllocateOp(request=follow_up("a", list(range(10)), [10, 11]), num_new_tokens=1)
    del bad_a.request.append_block_hashes[:]
    with pytest.raises(InvalidArgumentError, match="expected 1 new block hashes"):
        client.allocate("p", bad_a, sid, fence)
    with pytest.raises(InvalidArgumentError, match="exceed max_model_len 256"):
        client.allocate("p", allocate("a", None, 300, held=list(range(10))).allocate, sid, fence)
    assert state(client) == before
    with pytest.raises(NotFoundError):  # the failed calls registered nothing
        client.inspect_pool("p", request_ids=["b"])


def test_stale_hit_is_an_outcome_that_changes_nothing(client: KVCoordClient) -> None:
    """A hit whose blocks another request reused is answered stale_hit, pool unchanged."""
    sid, fence = attach(client)
    tokens = list(range(100, 112))
    client.allocate("p", allocate("a", tokens, 12).allocate, sid, fence)
    client.free("p", ["a"], session_id=sid, fence=fence)
    looked_up = state(client)
    hit = client.find_longest_cache_hit("p", hashes(tokens + [1]), 13).hit
    assert hit.num_tokens == 12
    assert state(client) == looked_up  # read-only: no request, no stats, same free queue
    # FindLongestCacheHit registers nothing: "b" is registered here, before the snapshot
    step = client.step(
        "p", [pb.Operation(sync=pb.SyncOp(request=new_request("b", tokens + [1])))], sid, fence
    )
    assert step.results[0].status_code == 0
    # fill the pool so the freed cached blocks are evicted and reused
    client.allocate("p", allocate("big", list(range(1000, 1000 + 120)), 120).allocate, sid, fence)
    client.free("p", ["big"], session_id=sid, fence=fence)
    before = state(client)
    op = pb.AllocateOp(request=follow_up("b", tokens + [1]), num_new_tokens=1, num_new_computed_tokens=12,
                       new_computed_blocks=hit)  # fmt: skip
    r = client.allocate("p", op, sid, fence).result
    assert r.stale_hit and not r.refused and not r.new_block_ids
    assert state(client) == before


def test_other_failed_preconditions(client: KVCoordClient) -> None:
    """Adopting a hit for a request that already holds blocks is FAILED_PRECONDITION; so is
    a sync at another position than the server's (SYNC_MISMATCH), re-registering a
    request, and a sync that names the request without the right base."""
    sid, fence = attach(client)
    client.allocate("p", allocate("a", list(range(12)), 12).allocate, sid, fence)
    ids = client.inspect_pool("p", request_ids=["a"]).requests[0].groups
    op = pb.AllocateOp(request=follow_up("a", list(range(12))), num_new_tokens=1, num_new_computed_tokens=4,
                       new_computed_blocks=pb.CacheHit(groups=[pb.BlockIds(block_ids=ids[0].block_ids[:1]),
                                                               pb.BlockIds(block_ids=[0])], num_tokens=4))  # fmt: skip
    with pytest.raises(FailedPreconditionError, match="already holds blocks"):
        client.allocate("p", op, sid, fence)
    before = state(client)
    stale = pb.AllocateOp(request=follow_up("a", list(range(8)), [8, 9, 10, 11]), num_new_tokens=1)
    with pytest.raises(SyncMismatchError, match="the server holds 12 / 3"):
        client.allocate("p", stale, sid, fence)
    with pytest.raises(SyncMismatchError, match="already registered"):
        client.allocate("p", allocate("a", list(range(12)), 12).allocate, sid, fence)
    bare = pb.Operation(sync=pb.SyncOp(request=pb.RequestSync(request_id="a")))  # no appends, base 0
    r = client.step("p", [bare], sid, fence).results[0]
    assert r.status_code == 9 and r.reason == pb.SYNC_MISMATCH
    assert (r.position.exists, r.position.num_tokens, r.position.num_hashes) == (True, 12, 3)
    assert state(client) == before


def test_atomic_lookup_allocate(client: KVCoordClient) -> None:
    """lookup=true adopts the hit in the same operation and schedules up to the budget."""
    sid, fence = attach(client)
    tokens = list(range(100, 120))
    client.allocate("p", allocate("a", tokens, 20).allocate, sid, fence)
    r = client.allocate("p", allocate("b", tokens + [5, 6], 100, lookup=True).allocate, sid, fence).result
    assert not r.refused and r.hit.num_tokens == 20 and r.num_new_tokens == 2
    assert [list(g.block_ids) for g in r.hit.groups] == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]
    assert [list(g.block_ids) for g in r.new_block_ids] == [[11], [12]]


def test_permission_denied_for_other_session(client: KVCoordClient) -> None:
    """A request created by one session cannot be freed by another."""
    s1, f1 = attach(client)
    s2, f2 = attach(client)
    client.allocate("p", allocate("a", list(range(10)), 10).allocate, s1, f1)
    with pytest.raises(PermissionDeniedError, match="another session"):
        client.free("p", ["a"], session_id=s2, fence=f2)
    with pytest.raises(PermissionDeniedError, match="another session"):
        client.allocate("p", allocate("a", None, 1, held=list(range(10))).allocate, s2, f2)
    client.free("p", ["a"], session_id=s1, fence=f1)


def test_resource_exhausted_limits(make_server: Callable[..., InProcessServer]) -> None:
    """max_pools, max_ops_per_step and max_requests_per_pool are RESOURCE_EXHAUSTED."""
    srv = make_server(POOL_TOML, limits=Limits(max_pools=1, max_ops_per_step=2, max_requests_per_pool=1))
    with KVCoordClient(srv.address) as c:
        sid, fence = attach(c)
        with pytest.raises(ResourceExhaustedError, match="max_pools"):
            c.create_pool("q", full_pool())
        c.step_piece_ops = 0  # (the client learned the cap at attach: send the Step whole)
        with pytest.raises(ResourceExhaustedError, match="limit is 2"):
            c.step("p", [pb.Operation(reset_prefix_cache=pb.ResetPrefixCacheOp())] * 3, sid, fence)
        c.allocate("p", allocate("a", list(range(4)), 4).allocate, sid, fence)
        with pytest.raises(ResourceExhaustedError, match="max_requests_per_pool"):
            c.allocate("p", allocate("b", list(range(4)), 4).allocate, sid, fence)


def test_refusal_is_a_result_not_an_error(client: KVCoordClient) -> None:
    """Too few free blocks is AllocateResult.refused, with the pool unchanged."""
    sid, fence = attach(client)
    before = state(client)
    r = client.allocate("p", allocate("huge", list(range(250)), 250).allocate, sid, fence)
    assert r.result.refused and not r.result.new_block_ids
    assert state(client)[1:] == before[1:]


def test_bearer_tokens(make_server: Callable[..., InProcessServer]) -> None:
    """With auth_tokens set, calls need a valid token (UNAUTHENTICATED otherwise); health stays open."""
    from kvcoord.client import PermissionDeniedError

    srv = make_server(POOL_TOML, auth_tokens=("s3cret",))
    with KVCoordClient(srv.address) as anonymous, KVCoordClient(srv.address, token="wrong") as wrong:
        assert anonymous.health() == "SERVING"
        for c in (anonymous, wrong):
            with pytest.raises(
                PermissionDeniedError, match="UNAUTHENTICATED: missing or invalid bearer token"
            ):
                c.list_pools()
            with pytest.raises(PermissionDeniedError, match="UNAUTHENTICATED"):
                list(c.watch_events("p", 0, timeout=2))
    with KVCoordClient(srv.address, token="s3cret") as ok:
        assert [p.name for p in ok.list_pools().pools] == ["p"]
