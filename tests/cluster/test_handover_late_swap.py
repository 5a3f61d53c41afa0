"""A handover whose claim swap reaches the store after the old owner gave up on it;
and one whose old owner cannot reach the store when its AdoptPool fails.

The old owner hands a pool over (AdoptPool); the adopter journals the state and swaps
the claim (compare-and-swap on the claim's revision), but its call to the store stalls
and its AdoptPool fails. The old owner then serves the pool again and acknowledges
allocations. When the stalled swap finally reaches the store, it must not land: were
it to, the adopter would serve the state it was sent, without those allocations, and
hand their blocks out again (silently: the worker's fence stays valid). Real etcd, two
real ``kvcoord serve`` replicas; the adopter reaches etcd through a proxy that holds
its swap (tcp_proxy.HoldingProxy). Both journal modes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.testing import ServerProcess, start_server
from service.helpers import allocate
from tcp_proxy import HoldingProxy, Proxy
from test_replicas import POOL_CONFIG, placed

T = TypeVar("T")


def _config(endpoint: str, replica: str, data_dir: Path, cluster: str, journal: str) -> str:
    return (
        f'[server]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\nlog_level = "INFO"\n'
        f"grace_seconds = 5.0\n"
        f'[cluster]\nendpoints = ["{endpoint}"]\nname = "{cluster}"\nreplica_id = "{replica}"\n'
        f'lease_seconds = 10\nstore_timeout_seconds = 2.0\njournal = "{journal}"\n'
    )


def _until(get: Callable[[], T | None], seconds: float, what: str) -> T:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = get()
        if value is not None:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s: {what}")


def _allocated(
    address: str, pool: str, rid: str, tokens: list[int], session_id: str, fence: object
) -> list[int] | None:
    """The blocks ``rid`` is given at ``address`` (one try), None when it is refused."""
    try:
        with KVCoordClient(address, timeout=2.0, retry=NO_RETRY) as c:
            got = c.allocate(pool, allocate(rid, tokens, 8).allocate, session_id, fence)  # type: ignore[arg-type]
    except KVCoordError:
        return None
    return list(got.result.new_block_ids[0].block_ids)


def _served(addresses: list[str], pool: str) -> dict[str, list[int]] | None:
    """The requests the pool's owner holds, and their blocks (None: not served)."""
    try:
        with KVCoordClient(addresses, timeout=2.0) as c:
            view = c.inspect_pool(pool, all_requests=True)
    except KVCoordError:
        return None
    return {r.request_id: list(r.groups[0].block_ids) for r in view.requests}


def _nothing_lost_or_given_twice(addresses: list[str], pool: str, acknowledged: dict[str, list[int]]) -> None:
    """The pool, wherever it is served now, holds every acknowledged allocation, and a
    new request is given none of their blocks."""
    assert _until(lambda: _served(addresses, pool), 40, "the pool is served") == acknowledged
    with KVCoordClient(addresses, timeout=5.0) as c:
        s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=120)
        r3 = c.allocate(pool, allocate("r3", list(range(200, 208)), 8).allocate, s.session_id, s.fence)
        given = list(r3.result.new_block_ids[0].block_ids)
    assert not set(given) & {i for ids in acknowledged.values() for i in ids}
    assert _until(lambda: _served(addresses, pool), 10, "the pool is served") == {**acknowledged, "r3": given}


def _created_with_one_request(address: str, pool: str) -> tuple[Any, dict[str, list[int]]]:
    """The pool created at ``address`` (replica a, alone), a session, and request r1's
    blocks: (the Attach answer, {"r1": its block ids})."""
    with KVCoordClient(address, timeout=5.0) as c:
        assert c.create_pool(pool, POOL_CONFIG).pool.replica == "a"
        s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=120)
        r1 = c.allocate(pool, allocate("r1", list(range(8)), 8).allocate, s.session_id, s.fence)
    return s, {"r1": list(r1.result.new_block_ids[0].block_ids)}


@pytest.mark.parametrize("journal", ["local", "store"])
def test_a_claim_swap_that_arrives_late_does_not_lose_what_the_old_owner_acknowledged(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, journal: str
) -> None:
    cluster = request.node.name.replace("[", "-").rstrip("]")
    pool = placed("late", "b", ["a", "b"])  # placement moves it to b once b joins
    a = start_server(_config(etcd.endpoint, "a", tmp_path / "a", cluster, journal), env=env())
    proxy = HoldingProxy(etcd.endpoint, b"owners/" + pool.encode())
    b: ServerProcess | None = None
    try:
        s, acknowledged = _created_with_one_request(a.address, pool)

        # b joins; a hands the pool over; b's swap of the claim is held on its way to etcd
        b = start_server(_config(proxy.address, "b", tmp_path / "b", cluster, journal), env=env())
        _until(lambda: proxy.marker_at, 30, "b sent its swap of the claim")

        acknowledged["r2"] = _until(  # a serves the pool again once its AdoptPool failed
            lambda: _allocated(a.address, pool, "r2", list(range(100, 108)), s.session_id, s.fence),
            20, "a serves the pool again",
        )  # fmt: skip
        assert proxy.release()  # the stalled swap reaches etcd now, long after b gave up on it
        time.sleep(1.0)  # (time for the late swap to be applied, had it matched)
        _nothing_lost_or_given_twice([a.address, b.address], pool, acknowledged)
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()
        proxy.close()


def test_a_failed_handover_is_served_again_once_the_store_answers(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The old owner cannot reach the store when its AdoptPool fails, so it cannot put
    its claim again (nor read who holds it): the pool is not served meanwhile, and is
    served again at the next pass once the store answers (was: never, until the
    replica restarted; its callers were told the owner was changing forever)."""
    cluster = request.node.name
    pool = placed("unsettled", "b", ["a", "b"])
    link = Proxy(etcd.endpoint)  # a's link to etcd
    a = start_server(_config(link.address, "a", tmp_path / "a", cluster, "local"), env=env())
    proxy = HoldingProxy(etcd.endpoint, b"owners/" + pool.encode())
    b: ServerProcess | None = None
    try:
        s, acknowledged = _created_with_one_request(a.address, pool)
        b = start_server(_config(proxy.address, "b", tmp_path / "b", cluster, "local"), env=env())
        _until(lambda: proxy.marker_at, 30, "b sent its swap of the claim")
        link.cut()  # b's AdoptPool fails after its 2 s store timeout; a's store calls fail too
        time.sleep(4.5)  # (within a's 10 s lease)
        assert _allocated(a.address, pool, "r2", list(range(100, 108)), s.session_id, s.fence) is None
        link.heal()
        acknowledged["r2"] = _until(
            lambda: _allocated(a.address, pool, "r2", list(range(100, 108)), s.session_id, s.fence),
            30, "a serves the pool again once the store answers",
        )  # fmt: skip
        assert proxy.release()
        time.sleep(1.0)
        _nothing_lost_or_given_twice([a.address, b.address], pool, acknowledged)
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()
        proxy.close()
        link.close()
