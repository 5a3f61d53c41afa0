"""A DeletePool of a pool nobody serves (its owner stopped without handing it over;
``journal = "store"``: ClusterStore.delete_unclaimed deletes its catalog entry and its
journal in the store) held on its way to etcd: the replica hears a timeout, the caller
OutcomeUnknownError. Meanwhile the pool goes on: a replica claims it, rebuilds it and
acknowledges allocations in it (its journal in the store), or the retried DeletePool
deletes it and it is made again; and then that owner dies (its lease ends: no claim).

The late delete was compared only on "nobody claims it" and "it is in the catalog", both
true again: it deleted the catalog entry and the journal of a pool whose acknowledged
allocations live nowhere else. Compared on the catalog entry's revision it read (every
claim writes the entry again, a pool made again is a new entry), it changes nothing.

A real replica in the test's process (real gRPC, the asyncio client) and a real etcd;
the other owner's claim, catalog entry and journal are written to etcd as a replica
writes them, under a lease the test then revokes (the owner's death as etcd sees it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aetcd import exceptions as aetcd_exceptions  # type: ignore[import-untyped]
from etcd_process import Etcd
from kvcoord.client import AsyncKVCoordClient, NotFoundError, OutcomeUnknownError
from kvcoord.service.cluster import Cluster
from kvcoord.service.cluster_store import prefix_range
from kvcoord.service.ownership import encode_claim
from replica_here import TRIES, replica_here, store_reader, unclaimed_in_catalog
from test_replicas import in_process_store_replica

#: no lease of r0 ends while a test holds a delete
LEASE = 30


async def _owner_came_and_died(other: Any, cluster: Cluster, pool: str) -> list[bytes]:
    """Another replica claims ``pool`` (claim, catalog entry, last holder: as
    ClusterStore.claim writes them), acknowledges records in its journal, and dies (its
    lease revoked). Returns the journal's keys."""
    lease = await other.lease(60)
    await other.put(cluster.key("owners", pool), encode_claim("r9", "127.0.0.1:9"), lease=lease.id)
    await other.put(cluster.key("pools", pool), b"")
    await other.put(cluster.key("last", pool), b"r9")
    assert cluster.streams is not None
    record = cluster.streams.pool_prefix(pool) + f"{1:020d}/{0:020d}/".encode() + b"000000/000001"
    await other.put(record, b"an acknowledged record")
    await lease.revoke()
    assert await other.get(cluster.key("owners", pool)) is None
    return [record]


async def _left(other: Any, cluster: Cluster, pool: str) -> list[bytes]:
    assert cluster.streams is not None
    rows = await other.get_range(*prefix_range(cluster.streams.pool_prefix(pool)))
    entry = [cluster.key("pools", pool)] if await other.get(cluster.key("pools", pool)) is not None else []
    return entry + [kv.key for kv in rows]


@pytest.mark.parametrize("meanwhile", ["claimed", "made again"])
def test_a_late_delete_of_a_pool_nobody_served_leaves_the_pool_served_since(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, meanwhile: str
) -> None:
    name = request.node.name[:40].replace(" ", "_")
    address, cfg = in_process_store_replica(etcd.endpoint, name, tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (_, cluster), store_reader(etcd.endpoint) as other:
            plain = cluster.client.transaction
            entry = cluster.key("pools", "gone")
            held: list[dict[str, Any]] = []

            async def tx(**kw: Any) -> Any:
                compare = {c.key for c in kw.get("compare", [])}
                if not held and entry in compare and cluster.key("owners", "gone") in compare:
                    held.append(kw)  # delete_unclaimed: on its way, no answer for now
                    raise aetcd_exceptions.ConnectionTimeoutError("Deadline Exceeded")
                return await plain(**kw)

            await unclaimed_in_catalog(other, cluster, "gone")
            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                cluster.client.transaction = tx
                with pytest.raises(OutcomeUnknownError):
                    await c.delete_pool("gone")
                assert len(held) == 1
                if meanwhile == "made again":
                    with pytest.raises(NotFoundError):  # (NotFound: the retry deleted it, or found it gone)
                        for _ in range(TRIES):  # bounded
                            await c.delete_pool("gone")
                    assert await _left(other, cluster, "gone") == []
            journal = await _owner_came_and_died(other, cluster, "gone")
            assert await _left(other, cluster, "gone") == [entry, *journal]

            ok, _ = await plain(**held[0])  # the first delete, carried out late
            assert not ok, f"the late delete of a pool nobody served deleted the pool {meanwhile} since"
            assert await _left(other, cluster, "gone") == [entry, *journal]

    asyncio.run(run())
