"""A replica served in the test's own process (its cluster view, registry and store
client reachable by the test, so a test can hold or break one store call), and the
store states the store-journal tests start from."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import cbor2
from kvcoord.service.cluster import Cluster
from kvcoord.service.cluster_store import store_client
from kvcoord.service.config import ServerConfig
from kvcoord.service.ownership import encode_claim
from kvcoord.service.registry_state import dump_pool
from kvcoord.service.server import RunningServer, start_server
from kvcoord.v1 import allocator_pb2 as pb
from test_replicas import POOL_CONFIG

#: attempts of a bounded wait for the replica's watch (0.5 s apart)
TRIES = 60


@asynccontextmanager
async def replica_here(cfg: ServerConfig) -> AsyncIterator[tuple[RunningServer, Cluster]]:
    """The replica of ``cfg`` started here, and its cluster; stopped (no grace) on leaving."""
    running = await start_server(cfg)
    try:
        assert running.cluster is not None, "not a replica: the config has no [cluster]"
        yield running, running.cluster
    finally:
        await running.stop(grace=0)


@asynccontextmanager
async def store_reader(endpoint: str) -> AsyncIterator[Any]:
    """A store client of the test's own (etcd at ``endpoint``), apart from the replica's."""
    other = store_client(endpoint, 5.0)
    await other.connect()
    try:
        yield other
    finally:
        await other.close()


async def unclaimed_in_catalog(store: Any, cluster: Cluster, pool: str) -> None:
    """``pool`` put in the catalog with nobody claiming it (its owner gone without a
    handover), never rebuilt here, and the replica's watch has read it."""
    cluster._retry_at[pool] = float("inf")  # the test plays its owners: not taken over here
    await store.put(cluster.key("pools", pool), b"")
    for _ in range(TRIES):  # bounded: the watch reads it
        if pool in cluster.view.catalog:
            break
        await asyncio.sleep(0.5)
    assert pool in cluster.view.catalog and pool not in cluster.view.claims


async def owned_by_a_gone_replica(
    c: Any, running: RunningServer, cluster: Cluster, pool: str
) -> pb.AdoptPoolRequest:
    """``pool`` made here and deleted, its claim then put for a replica that is gone (a
    member missing from the view: placement names this replica): the AdoptPool a handover's
    sender would send here for it (its state as dumped here, the claim's term)."""
    await c.create_pool(pool, POOL_CONFIG)
    state = cbor2.dumps(dump_pool(running.servicer.registry, pool, leases=True))
    await c.delete_pool(pool)
    await cluster.client.put(cluster.key("owners", pool), encode_claim("gone", "127.0.0.1:9"))
    await cluster.client.put(cluster.key("pools", pool), b"")
    await cluster.refresh()
    assert cluster.view.claims[pool].replica_id == "gone"
    return pb.AdoptPoolRequest(
        pool=pool, state=state, from_replica="gone", claim_revision=cluster.view.term(pool)
    )
