"""A DeletePool naming an incarnation (DeletePoolRequest.incarnation) of a pool nobody
serves, with its journal in the cluster store: the incarnation is in that journal,
which nobody has read, so the delete is not carried out by name in the store; it is
answered as any call of a pool being taken over (UNAVAILABLE, OWNER_CHANGING) and its
catalog entry (and journal) stay, to be checked once a replica serves the pool. (Deleted
by name it could be a pool made again since the caller learnt its incarnation.) A real
replica in the test's process and a real etcd."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, AsyncKVCoordClient, KVCoordError
from replica_here import replica_here, store_reader, unclaimed_in_catalog
from test_replicas import in_process_store_replica

#: no lease of r0 ends during the test
LEASE = 30


def test_a_delete_naming_an_incarnation_leaves_a_pool_nobody_serves(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    name = request.node.name[:40].replace(" ", "_")
    address, cfg = in_process_store_replica(etcd.endpoint, name, tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (_, cluster), store_reader(etcd.endpoint) as other:
            await unclaimed_in_catalog(other, cluster, "gone")
            entry = cluster.key("pools", "gone")
            async with AsyncKVCoordClient(address, timeout=20.0, retry=NO_RETRY) as c:
                with pytest.raises(KVCoordError) as refused:
                    await c.delete_pool("gone", incarnation=12345)
            assert refused.value.reason == "OWNER_CHANGING", refused.value
            assert await other.get(entry) is not None  # (was: deleted by name, answered OK)
            assert "gone" in cluster.view.catalog
            async with AsyncKVCoordClient(address, timeout=20.0, retry=NO_RETRY) as c:
                await c.delete_pool("gone")  # naming none: deleted there, as before
            assert await other.get(entry) is None

    asyncio.run(run())
