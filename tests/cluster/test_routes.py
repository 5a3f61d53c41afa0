"""The client's routing table (kvcoord.client.owners), directly."""

from __future__ import annotations

import grpc
import pytest
from kvcoord.client.owners import Routes, parse_targets, resolve
from kvcoord.v1 import allocator_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_targets_are_a_list_or_a_comma_separated_string() -> None:
    assert parse_targets("a:1, b:2,") == ["a:1", "b:2"]
    assert parse_targets(["a:1", "b:2"]) == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        parse_targets(" , ")
    assert resolve("127.0.0.1:5") == ["127.0.0.1:5"]
    assert resolve("unix:/tmp/s") == ["unix:/tmp/s"]
    assert resolve("no-such-host.invalid:5") == ["no-such-host.invalid:5"]


def test_a_dns_name_is_every_replica_it_resolves_to_and_is_resolved_again() -> None:
    records = {"kvcoord.ns.svc:50051": ["10.0.0.1:50051", "10.0.0.2:50051"]}
    clock = Clock()
    routes = Routes("kvcoord.ns.svc:50051", lambda e: list(records[e]), clock)
    assert routes.addresses == ["10.0.0.1:50051", "10.0.0.2:50051"]
    records["kvcoord.ns.svc:50051"] = ["10.0.0.2:50051", "10.0.0.3:50051"]
    routes.unreachable("p", "10.0.0.1:50051")  # within RESOLVE_EVERY: not resolved again
    assert routes.addresses == ["10.0.0.2:50051", "10.0.0.1:50051"]
    clock.now += 5
    routes.unreachable("p", "10.0.0.2:50051")  # resolved again: the addresses marked down stay last
    assert routes.addresses == ["10.0.0.3:50051", "10.0.0.2:50051", "10.0.0.1:50051"]


def test_pools_go_to_their_learned_owner_and_sessions_to_their_pool() -> None:
    routes = Routes(["a:1", "b:1", "c:1"], lambda e: [e])
    assert routes.route("p") == "a:1"
    routes.redirected("p", "c:1")
    assert routes.route("p") == "c:1"
    routes.redirected("q", "d:1")  # an owner outside the given set is learned
    assert routes.route("q") == "d:1" and "d:1" in routes.addresses
    attach = pb.AttachRequest(pool="p")
    routes.answered("Attach", attach, pb.AttachResponse(session_id="s1"), "p", "c:1")
    assert routes.pool_of("Heartbeat", pb.HeartbeatRequest(session_id="s1")) == "p"
    assert routes.pool_of("Step", pb.StepRequest(pool="x", session_id="s1")) == "x"
    assert routes.pool_of("CreatePool", pb.CreatePoolRequest(name="n")) == "n"
    assert routes.pool_of("ListPools", pb.ListPoolsRequest()) == ""
    routes.answered("Detach", pb.DetachRequest(session_id="s1"), pb.DetachResponse(), "p", "c:1")
    assert routes.pool_of("Heartbeat", pb.HeartbeatRequest(session_id="s1")) == ""
    routes.unreachable("p", "c:1")  # the owner is forgotten, its address tried last
    assert routes.route("p") == "a:1" and routes.addresses[-1] == "c:1"


def test_redirects_are_followed_a_bounded_number_of_times() -> None:
    import grpc
    from kvcoord.client import NotOwnerError, UnavailableError
    from kvcoord.client.owners import AGAIN, MAX_HOPS

    routes = Routes(["127.0.0.1:1", "127.0.0.1:2"], lambda e: [e], Clock())
    err = NotOwnerError(grpc.StatusCode.FAILED_PRECONDITION, "elsewhere", "NOT_OWNER")
    err.owner = "127.0.0.1:3"
    assert routes.failed(err, "p", "127.0.0.1:1", 0, "read") == AGAIN and routes.route("p") == "127.0.0.1:3"
    assert not routes.failed(err, "p", "127.0.0.1:3", MAX_HOPS, "read")  # past the bound: the policy
    nameless = NotOwnerError(grpc.StatusCode.FAILED_PRECONDITION, "elsewhere", "NOT_OWNER")
    assert not routes.failed(nameless, "p", "127.0.0.1:3", 0, "read")  # no owner named: nothing to follow
    down = UnavailableError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert not routes.failed(down, "p", "127.0.0.1:3", 0, "once")  # an unkeyed mutation: never again
    assert routes.route("p") == "127.0.0.1:1"


def test_a_dead_owner_stays_last_and_its_redirects_wait_until_it_answers_again() -> None:
    import grpc
    from kvcoord.client import NotOwnerError, OwnerChangingError, UnavailableError
    from kvcoord.client.owners import AGAIN, SETTLE

    clock = Clock()
    routes = Routes(["a:1", "b:1", "c:1"], lambda e: [e], clock)
    routes.redirected("p", "a:1")
    refused = UnavailableError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert routes.failed(refused, "p", "a:1", 0, "keyed") == AGAIN  # ask a live replica at once
    assert routes.route("p") == "b:1"
    stale = NotOwnerError(grpc.StatusCode.FAILED_PRECONDITION, "served by a:1", "NOT_OWNER")
    stale.owner = "a:1"
    assert routes.failed(stale, "p", "b:1", 1, "keyed") == SETTLE  # not followed: pause, ask again
    assert routes.failed(stale, "p", "b:1", 0, "once") == ""  # an unkeyed mutation gets the error
    assert routes.route("p") == "b:1"
    clock.now += 5  # past RECHECK_DOWN; resolved again: the dead address stays last
    routes.refresh()
    assert routes.addresses == ["b:1", "c:1", "a:1"]
    assert routes.failed(stale, "p", "b:1", 0, "keyed") == AGAIN  # marked long ago: checked again
    assert routes.route("p") == "a:1"
    routes.answered("GetPool", pb.GetPoolRequest(name="p"), pb.GetPoolResponse(), "p", "a:1")
    assert "a:1" not in routes.down
    clock.now += 5
    routes.refresh()
    assert routes.addresses == ["a:1", "b:1", "c:1"]  # it answered: the configured order again
    taking = OwnerChangingError(grpc.StatusCode.UNAVAILABLE, "taking it over", "OWNER_CHANGING")
    assert routes.failed(taking, "p", "c:1", 0, "read") == SETTLE and routes.route("p") == "c:1"


def test_routes_shared_by_threads_stay_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocking client is called from several threads at once (a manager's sender
    thread and the scheduler's): they all learn into one Routes. Hammered from eight
    threads (answers, sessions past MAX_SESSIONS, redirects, unreachable owners, pool
    lists merged), no call raises and the table stays whole: each address once, every
    known owner one of them, at most MAX_SESSIONS sessions, the primary an address."""
    import random
    import sys
    import threading

    from kvcoord.client import owners
    from kvcoord.client.api import merged
    from kvcoord.client.errors import NotOwnerError, UnavailableError

    monkeypatch.setattr(owners, "MAX_SESSIONS", 4)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    clock = Clock()
    routes = Routes(["a:1", "b:2", "c:3"], clock=clock)
    pools = [f"p{i}" for i in range(4)]
    addresses = ["a:1", "b:2", "c:3", "d:4"]  # d:4 is learned from redirects
    failures: list[BaseException] = []
    start = threading.Barrier(8)

    def hammer(seed: int) -> None:
        rnd = random.Random(seed)
        start.wait()
        try:
            for i in range(2_000):
                # the address called is one the table knows (the client calls route()'s)
                pool, address = rnd.choice(pools), rnd.choice(list(routes.addresses))
                clock.now += 0.001
                step = rnd.randrange(7)
                if step == 0:
                    attach = pb.AttachRequest(pool=pool)
                    routes.answered(
                        "Attach", attach, pb.AttachResponse(session_id=f"s{seed}.{i}"), pool, address
                    )
                elif step == 1:
                    gone = pb.DetachRequest(session_id=f"s{rnd.randrange(8)}.{rnd.randrange(i + 1)}")
                    routes.answered("Detach", gone, pb.DetachResponse(), pool, address)
                elif step == 2:
                    err = NotOwnerError(grpc.StatusCode.FAILED_PRECONDITION, "not mine", "NOT_OWNER")
                    err.owner = rnd.choice(addresses)
                    routes.failed(err, pool, address, 0, "read")
                elif step == 3:
                    routes.failed(
                        UnavailableError(grpc.StatusCode.UNAVAILABLE, "reset"), pool, address, 0, "keyed"
                    )
                elif step == 4:
                    routes.unreachable(pool, address)
                elif step == 5:
                    listed = pb.ListPoolsResponse(pools=[pb.PoolInfo(name=p) for p in pools[:2]])
                    merged(routes, [(address, listed)])
                else:
                    routes.pool_of("Heartbeat", pb.HeartbeatRequest(session_id=f"s{seed}.{i - 1}"))
                    assert routes.route(pool) in routes.addresses
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert failures == []
    assert len(routes.addresses) == len(set(routes.addresses)) == 4
    assert set(routes.addresses) == set(addresses) and routes.primary in addresses
    assert set(routes.owner.values()) <= set(addresses)
    assert len(routes.session_pool) <= 4


def test_a_reader_never_sees_an_address_list_missing_one() -> None:
    """A replica marked down moves to the end of the list. A thread routing a call
    at that moment (no lock: ``route``, ``primary``, the list itself) sees every
    address: the list is replaced whole, never changed in place (the in-place
    remove-then-append showed readers a list one address short: CI at 9f7ead7)."""
    import sys
    import threading

    clock = Clock()
    routes = Routes(["a:1", "b:2", "c:3"], clock=clock)
    stop = threading.Event()
    short: list[list[str]] = []

    def mark_down() -> None:
        try:
            for i in range(20_000):
                routes.unreachable("p", ("a:1", "b:2", "c:3")[i % 3])
        finally:
            stop.set()

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    writer = threading.Thread(target=mark_down)
    try:
        writer.start()
        while not stop.is_set():
            seen = routes.addresses
            if len(seen) != 3:
                short.append(list(seen))
    finally:
        sys.setswitchinterval(old_interval)
        writer.join()
    assert short == []
    assert sorted(routes.addresses) == ["a:1", "b:2", "c:3"]


def test_a_redirect_names_its_replica_and_a_refusal_as_another_replica_is_asked_elsewhere() -> None:
    """A redirect's ``kvcoord-owner-replica`` is what the calls sent to that address
    name; a server there that is not that replica refuses (WRONG_REPLICA), which
    applied nothing: even an unkeyed mutation goes at once to another replica, and the
    address is the pool's owner no more."""
    from kvcoord.client import NotOwnerError, WrongReplicaError
    from kvcoord.client.errors import error_from_rpc, never_sent
    from kvcoord.client.owners import AGAIN

    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self) -> str:
            return "served by r2"

        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return (
                ("kvcoord-reason", "NOT_OWNER"),
                ("kvcoord-owner", "c:1"),
                ("kvcoord-owner-replica", "k/r2"),
            )

    redirect = error_from_rpc(Refused(), "Step")
    assert isinstance(redirect, NotOwnerError) and (redirect.owner, redirect.owner_replica) == ("c:1", "k/r2")
    routes = Routes(["a:1", "b:1"], lambda e: [e], Clock())
    assert routes.failed(redirect, "p", "a:1", 0, "once") == AGAIN
    assert routes.route("p") == "c:1" and routes.named == {"c:1": "k/r2"}
    wrong = WrongReplicaError(grpc.StatusCode.UNAVAILABLE, "meant for 'k/r2'", "WRONG_REPLICA")
    assert never_sent(wrong)  # nothing applied: any call may go elsewhere
    assert routes.failed(wrong, "p", "c:1", 1, "once") == AGAIN
    assert routes.route("p") == "a:1" and "c:1" in routes.down
    nameless = NotOwnerError(grpc.StatusCode.FAILED_PRECONDITION, "served by c:1", "NOT_OWNER")
    nameless.owner = "c:1"  # a replica of an earlier release names none: nothing is checked there
    routes.redirected("p", "c:1", "a:1", nameless.owner_replica)
    assert routes.named == {}


def test_an_answer_describing_its_pool_names_the_replica_that_gave_it() -> None:
    """An Attach, GetPool or CreatePool answer (PoolInfo.replica_name) and a ListPools
    listing name the replica at the address that answered: calls sent there name it
    from then on, though no redirect ever pointed there; one naming none (a single node,
    a replica of an earlier release) leaves nothing to check there."""
    routes = Routes(["a:1", "b:1"], lambda e: [e], Clock())
    attached = pb.AttachResponse(session_id="s1", pool=pb.PoolInfo(name="p", replica_name="k/r1"))
    routes.answered("Attach", pb.AttachRequest(pool="p"), attached, "p", "b:1")
    routes.listed("q", "a:1", "k/r0")
    assert routes.named == {"b:1": "k/r1", "a:1": "k/r0"}
    routes.answered("GetStats", pb.GetStatsRequest(pool="p"), pb.GetStatsResponse(), "p", "b:1")
    assert routes.named["b:1"] == "k/r1"  # (an answer that describes no pool changes nothing)
    plain = pb.GetPoolResponse(pool=pb.PoolInfo(name="p"))
    routes.answered("GetPool", pb.GetPoolRequest(name="p"), plain, "p", "b:1")
    assert routes.named == {"a:1": "k/r0"}


def test_a_refusal_as_another_replica_renames_the_address_for_its_cluster() -> None:
    """After WRONG_REPLICA at an address named "k/r1", calls there name "k/*": a replica
    of cluster k given that address since (a recycled pod IP) serves them, any other
    server still refuses (was: "k/r1", refused there for good). A call naming no pool
    (ScorePools, ListPools) goes to the next replica at once too."""
    from kvcoord.client import WrongReplicaError
    from kvcoord.client.owners import AGAIN

    routes = Routes(["a:1", "b:1"], lambda e: [e], Clock())
    routes.listed("p", "a:1", "k/r1")
    wrong = WrongReplicaError(grpc.StatusCode.UNAVAILABLE, "meant for 'k/r1'", "WRONG_REPLICA")
    assert routes.failed(wrong, "", "a:1", 0, "read") == AGAIN  # (no pool named)
    assert routes.named == {"a:1": "k/*"} and routes.primary == "b:1"
    assert routes.failed(wrong, "p", "a:1", 0, "once") == AGAIN
    assert routes.named == {"a:1": "k/*"}  # (a cluster's name stays: refused by any other server)
    lone = Routes(["a:1"], lambda e: [e], Clock())
    lone.listed("p", "a:1", "k/r1")
    assert lone.failed(wrong, "p", "a:1", 0, "read") == ""  # the policy decides: the same address, renamed
    assert lone.named == {"a:1": "k/*"}
