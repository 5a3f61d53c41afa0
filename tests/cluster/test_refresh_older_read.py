"""A read of the cluster store applied after a newer one (Cluster.refresh).

A replica reads members, claims and the catalog from several tasks: the watch's pass,
the keep-alive after its lease ended (register again, read again), a DeletePool, a
failed reclaim. Each read is several store calls, awaited, and applied when the last
one answers, with no check of the revision it was read at against what the view holds
already. A read begun before the replica's lease ended can then be applied after the
keep-alive registered again: the claims it lists under this replica (the store deleted
them with the lease) come back into the view with a valid lease, and the replica serves
a pool whose claim it no longer holds, beside the replica that took the pool over and
rebuilt it from the store: reads (a router's scores and hits, lookups) answered from the
old copy, the state before the takeover (Ownership.lease_lost's bug again, by a race),
and a write applied to the old copy before the store refuses its journal record. The
same holds for an older read applied after a newer one: the view goes back to the older
claims until the next pass.

Real etcd, the replica's own Cluster in-process; the first read is held after its claims
came back (a wrapper around the store client's get_prefix), as a slow store answer
holds it. Where it lands: before the keep-alive registers again (lease ended, the
view's own claims dropped), after that registration, or after the keep-alive's newer
read."""

from __future__ import annotations

import asyncio

import pytest
from etcd_process import Etcd
from kvcoord.service.cluster import Cluster
from kvcoord.service.cluster_store import store_client
from kvcoord.service.errors import ErrorReason, ServiceError
from kvcoord.service.ownership import Member, encode_claim

#: a bound on every wait here, not a measurement
BOUND = 30.0
POOL = "p"


async def _replica(etcd: Etcd, name: str) -> Cluster:
    """Replica r0, registered, holding the claim of POOL."""
    cluster = Cluster([etcd.endpoint], name, Member("r0", "127.0.0.1:1001"), 30, 5.0)
    cluster.client = store_client(etcd.endpoint, 5.0)
    await cluster.client.connect()
    await cluster.register()
    await cluster.refresh()
    assert await cluster.claim(POOL) is not None
    assert cluster.view.holds(POOL)
    return cluster


def _hold_next_read(cluster: Cluster) -> tuple[asyncio.Event, asyncio.Event]:
    """The next refresh is held once its read of the claims answered: (held, release)."""
    real = cluster.client.get_prefix
    held, release = asyncio.Event(), asyncio.Event()

    async def get_prefix(key: bytes, **kwargs: object) -> object:
        answer = await real(key, **kwargs)
        if key == cluster.key("owners") and not held.is_set():
            held.set()
            await release.wait()
        return answer

    cluster.client.get_prefix = get_prefix
    return held, release


async def _take_over(cluster: Cluster) -> None:
    """Replica r1 claims POOL (r0's claim went with its lease)."""
    other = store_client(cluster.endpoints[0], 5.0)
    await other.connect()
    try:
        await other.put(cluster.key("owners", POOL), encode_claim("r1", "127.0.0.1:1002"))
    finally:
        await other.close()


def _served_here(cluster: Cluster) -> bool:
    """Whether a call of POOL is served by r0 (else refused: redirected, or retried)."""
    try:
        cluster.view.check(POOL, local=True)
    except ServiceError:
        return False
    return True


def _redirected_to_r1(cluster: Cluster) -> None:
    with pytest.raises(ServiceError) as err:
        cluster.view.check(POOL, local=True)
    assert err.value.reason is ErrorReason.NOT_OWNER and err.value.owner == "127.0.0.1:1002", err.value


@pytest.mark.parametrize("lands", ["before_registering", "after_registering", "after_a_newer_read"])
def test_a_read_begun_before_the_lease_ended_brings_no_claim_back(
    etcd: Etcd, request: pytest.FixtureRequest, lands: str
) -> None:
    """r0 holds POOL; the watch's read is held once its claims answered (POOL is r0's);
    r0's lease ends at the store (a stall longer than the lease: its claims go with it)
    and r1 claims POOL; the keep-alive learns the lease ended and registers again (then
    reads the view again). Wherever the held read is applied, r0 never serves POOL
    after its registration, and the next read redirects POOL's calls to r1 (was: the
    held read's claims came back, served with the new lease)."""

    async def run() -> None:
        cluster = await _replica(etcd, f"older-read-{lands}")
        try:
            held, release = _hold_next_read(cluster)
            older = asyncio.get_running_loop().create_task(cluster.refresh())  # the watch's pass
            await asyncio.wait_for(held.wait(), BOUND)
            await cluster.client.revoke_lease(cluster.lease.id)
            await _take_over(cluster)
            cluster.view.lease_lost()  # (Cluster._keep_alive)
            if lands == "before_registering":
                release.set()
                await asyncio.wait_for(older, BOUND)
            await cluster.register()
            if lands == "after_a_newer_read":
                await cluster.refresh()
                _redirected_to_r1(cluster)
            release.set()
            await asyncio.wait_for(older, BOUND)
            claim = cluster.view.claims.get(POOL)
            assert not _served_here(cluster), (
                f"r0 serves {POOL!r} after registering again (the view's claim {claim}; the store's is r1's)"
            )
            await cluster.refresh()  # the next pass
            _redirected_to_r1(cluster)
        finally:
            await cluster.stop()

    asyncio.run(run())
