"""The placement and serving rules of a sharded cluster (service/ownership.py), directly,
and the [cluster] configuration."""

from __future__ import annotations

import collections
import math

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcoord.service.config import ConfigFileError, load_config, parse_config
from kvcoord.service.errors import ErrorReason, ServiceError
from kvcoord.service.ownership import (
    Claim,
    Member,
    Ownership,
    decode_claim,
    decode_member,
    encode_claim,
    encode_member,
    moved_pools,
    owner_of,
)

POOLS = [f"pool-{i}" for i in range(400)]


def members(*ids: str) -> list[Member]:
    return [Member(i, f"10.0.0.{n}:50051") for n, i in enumerate(ids, 1)]


ids = st.lists(st.text("abcdefgh0123", min_size=1, max_size=6), min_size=1, max_size=6, unique=True)


@settings(max_examples=60, deadline=None)
@given(ids, st.text("abcdefgh0123", min_size=1, max_size=6))
def test_a_joining_member_takes_only_the_pools_it_wins(before: list[str], joiner: str) -> None:
    """Adding a member moves a pool only to the joiner; removing it moves back exactly those."""
    if joiner in before:
        return
    old = members(*before)
    new = [*old, Member(joiner, "10.9.9.9:50051")]
    moved = moved_pools(POOLS, old, new)
    for pool, (a, b) in moved.items():
        assert b is not None and b.replica_id == joiner, pool
        assert a is not None and a.replica_id != joiner
    for pool in POOLS:
        if pool not in moved:
            assert owner_of(pool, old) == owner_of(pool, new)
    # the reverse (the joiner leaves) moves the same pools and no other
    assert set(moved_pools(POOLS, new, old)) == set(moved)


@settings(max_examples=60, deadline=None)
@given(ids)
def test_a_leaving_member_gives_up_only_its_own_pools(present: list[str]) -> None:
    everyone = members(*present)
    leaver = everyone[0]
    rest = everyone[1:]
    moved = moved_pools(POOLS, everyone, rest)
    assert set(moved) == {p for p in POOLS if owner_of(p, everyone) == leaver}


def test_placement_is_the_same_whatever_the_order_and_spreads_pools() -> None:
    m = members("a", "b", "c")
    for pool in POOLS[:50]:
        assert owner_of(pool, m) == owner_of(pool, list(reversed(m)))
    counts = collections.Counter(owner_of(p, m).replica_id for p in POOLS)  # type: ignore[union-attr]
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) > len(POOLS) / 6  # no member starves (expected 1/3 each)
    assert owner_of("x", []) is None


def test_records_round_trip_and_bad_ones_are_refused() -> None:
    m = Member("r1", "h:1")
    assert decode_member(encode_member(m)) == m
    assert decode_claim("p", encode_claim("r1", "h:1"), 7) == Claim("p", "r1", "h:1", 7)
    with pytest.raises(ValueError):
        decode_member(b'{"replica": 3}')


def _view(me: str = "a", *others: str) -> Ownership:
    o = Ownership(Member(me, f"{me}:1"))
    o.set_members([Member(i, f"{i}:1") for i in (me, *others)])
    o.valid_until = math.inf
    return o


def _pool_placed_on(o: Ownership, replica: str) -> str:
    return next(p for p in POOLS if owner_of(p, o.members.values()).replica_id == replica)  # type: ignore[union-attr]


def test_the_claim_holder_serves_whatever_placement_says() -> None:
    o = _view("a", "b")
    pool = _pool_placed_on(o, "b")
    o.set_claims([Claim(pool, "a", "a:1", 5)])
    o.check(pool, local=True)  # held here: served (until handed over)
    assert o.holds(pool) and o.owned() == [pool] and o.term(pool) == 5


def test_another_holder_is_a_redirect_naming_its_address() -> None:
    o = _view("a", "b")
    pool = _pool_placed_on(o, "a")
    o.set_claims([Claim(pool, "b", "b:1", 3)])
    with pytest.raises(ServiceError) as err:
        o.check(pool, local=True)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.reason is ErrorReason.NOT_OWNER and err.value.owner == "b:1"


def test_an_unclaimed_pool_goes_to_its_placed_member() -> None:
    o = _view("a", "b")
    there, here = _pool_placed_on(o, "b"), _pool_placed_on(o, "a")
    with pytest.raises(ServiceError) as err:
        o.check(there, local=False)
    assert err.value.reason is ErrorReason.NOT_OWNER and err.value.owner == "b:1"
    o.check(here, local=False)  # placed here, nobody has it: CreatePool may claim it
    with pytest.raises(ServiceError) as err:  # state here but no claim yet: never served unclaimed
        o.check(here, local=True)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.reason is ErrorReason.OWNER_CHANGING  # clients keep asking this replica
    o.set_catalog([here])  # exists in the cluster, its holder gone: not "not found"
    with pytest.raises(ServiceError) as err:
        o.check(here, local=False)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.reason is ErrorReason.OWNER_CHANGING
    o.moving.add(there)  # a pool being handed over or rebuilt here
    with pytest.raises(ServiceError) as err:
        o.check(there, local=True)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.reason is ErrorReason.OWNER_CHANGING
    o.moving.discard(there)
    assert o.should_claim([here, there]) == sorted([here, there])


def test_without_a_valid_lease_nothing_is_served() -> None:
    o = _view("a")
    pool = POOLS[0]
    o.set_claims([Claim(pool, "a", "a:1", 1)])
    o.valid_until = 0.0
    assert not o.holds(pool) and o.owned() == []
    with pytest.raises(ServiceError) as err:
        o.check(pool, local=True)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_cluster_config_file_and_environment() -> None:
    assert not parse_config("").cluster.enabled  # absent: a single node
    cfg = parse_config(
        '[cluster]\nendpoints = ["127.0.0.1:2379"]\nname = "c1"\nreplica_id = "r0"\n'
        'advertise_address = "h:5"\nlease_seconds = 4\n'
    )
    assert cfg.cluster.enabled and cfg.cluster.endpoints == ("127.0.0.1:2379",)
    assert (cfg.cluster.name, cfg.cluster.replica_id, cfg.cluster.lease_seconds) == ("c1", "r0", 4)
    env = {
        "KVCOORD_CLUSTER_ENDPOINTS": "e1:2379, e2:2379",
        "KVCOORD_REPLICA_ID": "kvcoord-1",
        "KVCOORD_ADVERTISE_ADDRESS": "kvcoord-1.kvcoord:50051",
        "KVCOORD_CLUSTER_NAME": "prod",
        "KVCOORD_DURABILITY": "none",
    }
    c = load_config(env=env).cluster
    assert c.endpoints == ("e1:2379", "e2:2379")
    assert (c.replica_id, c.advertise_address, c.name) == ("kvcoord-1", "kvcoord-1.kvcoord:50051", "prod")
    bad_names = (
        'name = "a b"',
        'name = "caf\u00e9"',
        'replica_id = "r 1"',
        'replica_id = "r\u00e9"',
        'replica_id = "*"',
    )  # (metadata)
    for bad in (
        'endpoints = "h:1"',
        'endpoints = ["nohost"]',
        "lease_seconds = 1",
        'name = "a/b"',
        "x = 1",
        *bad_names,
    ):
        with pytest.raises(ConfigFileError, match="cluster"):
            parse_config(f"[cluster]\n{bad}\n")


def test_a_stale_read_does_not_bring_an_old_claim_holder_back() -> None:
    o = _view("a", "b")
    pool = POOLS[0]
    o.set_claims([Claim(pool, "b", "b:1", 10)], revision=10)
    o.learned(pool, Claim(pool, "a", "a:1", 12), 12)  # taken over here at revision 12
    o.set_claims([Claim(pool, "b", "b:1", 10)], revision=11)  # a read that started before
    assert o.holds(pool)
    o.set_claims([Claim(pool, "b", "b:1", 13)], revision=13)  # a later change wins
    assert not o.holds(pool) and o.claims[pool].term == 13
    o.learned(pool, None, 20)  # released here
    o.set_claims([Claim(pool, "b", "b:1", 13)], revision=15)
    assert pool not in o.claims


def test_hand_overs_and_leaving_follow_placement() -> None:
    o = _view("a", "b", "c")
    mine = [p for p in POOLS[:60]]
    o.set_claims([Claim(p, "a", "a:1", 1) for p in mine])
    moves = o.hand_overs()
    assert moves == {
        p: owner_of(p, o.members.values()) for p in mine if owner_of(p, o.members.values()).replica_id != "a"
    }  # type: ignore[union-attr]
    leaving = o.leaving()
    others = [m for m in o.members.values() if m.replica_id != "a"]
    assert set(leaving) == set(mine) and all(leaving[p] == owner_of(p, others) for p in mine)
    assert all(_view("b", "a", "c").may_adopt(p, "a") for p in mine if owner_of(p, others).replica_id == "b")  # type: ignore[union-attr]
    o.moving.add(mine[0])
    with pytest.raises(ServiceError) as err:
        o.check(mine[0], local=True)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_call_is_served_only_by_the_replica_it_names() -> None:
    """A redirect names its owner ("<cluster>/<replica id>", in a trailer of its own);
    a call naming a replica is refused by any other server, WRONG_REPLICA, and one
    naming none by nobody."""
    from kvcoord.service.errors import _trailers
    from kvcoord.service.ownership import check_addressed, not_owner, replica_name

    o = Ownership(Member("r0", "r0:1"), cluster="k")
    o.valid_until = float("inf")
    o.set_members([Member("r0", "r0:1"), Member("r1", "r1:1")])
    o.set_claims([Claim("p", "r1", "r1:1", 5)])
    with pytest.raises(ServiceError) as redirect:
        o.check("p", local=False)
    assert dict(_trailers(redirect.value)) == {
        "kvcoord-reason": "NOT_OWNER", "kvcoord-owner": "r1:1", "kvcoord-owner-replica": "k/r1",
    }  # fmt: skip
    assert replica_name("k", "r1") == "k/r1"
    check_addressed((("authorization", "Bearer t"),), "k/r0")  # named nobody: any server
    check_addressed((("kvcoord-replica", "k/r1"),), "k/r1")
    check_addressed((("kvcoord-replica", b"k/r1"),), "k/r1")
    check_addressed((("kvcoord-replica", "k/*"),), "k/r0")  # any replica of cluster k
    for named, me in [("k/r1", "k/r0"), ("k/r1", "other/r1"), ("k/r1", ""), ("k/*", "other/r0"), ("k/*", "")]:
        with pytest.raises(ServiceError) as refused:  # another replica, another cluster, a single node
            check_addressed((("kvcoord-replica", named),), me)
        assert (
            refused.value.reason is ErrorReason.WRONG_REPLICA
            and refused.value.code == grpc.StatusCode.UNAVAILABLE
        )
    assert dict(_trailers(not_owner("p", "r1", "r1:1", "r0"))) == {
        "kvcoord-reason": "NOT_OWNER", "kvcoord-owner": "r1:1", "kvcoord-owner-replica": "/r1",
    }  # fmt: skip
