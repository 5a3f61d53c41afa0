"""Races of a store-journal cluster while it settles, against a real etcd: a pool
created while the replica re-reads the store is not taken for an orphan (and rebuilt
by its own owner), and a delete whose claim moved away changes nothing here."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from etcd_process import Etcd
from kvcoord.service.cluster import Cluster, _client
from kvcoord.service.ownership import Member, owner_of


async def _joined(etcd: Etcd, name: str, replica: str = "r0") -> Cluster:
    cluster = Cluster([etcd.endpoint], name, Member(replica, f"127.0.0.1:{1000 + len(replica)}"), 5, 2.0)
    cluster.client = _client(etcd.endpoint, 2.0)
    await cluster.client.connect()
    await cluster._register()
    await cluster.refresh()
    return cluster


def test_a_pool_created_while_the_view_is_read_is_not_an_orphan(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    """The claim and the catalog entry of a new pool are one transaction; a refresh
    that reads one of them before it and the other after must not see a pool of the
    catalog that nobody claims (run-s7: the owner rebuilt its own new pool)."""
    name = request.node.name[:40]

    async def run() -> None:
        cluster = await _joined(etcd, name)
        try:
            pool = "fresh"
            assert owner_of(pool, cluster.view.members.values()) == cluster.me  # the only member
            plain, plain_tx = cluster.client.get_prefix, cluster.client.transaction
            committed, answered = asyncio.Event(), asyncio.Event()

            async def slow_answer(*a: Any, **kw: Any) -> Any:  # committed in etcd, answer still on its way
                out = await plain_tx(*a, **kw)
                committed.set()
                await answered.wait()
                return out

            reads: list[bytes] = []
            creating: list[asyncio.Task[Any]] = []

            async def racing_read(prefix: bytes, **kw: Any) -> Any:
                rows = await plain(prefix, **kw)
                if prefix != cluster._key("members"):
                    reads.append(prefix)
                    if len(reads) == 1:  # CreatePool's claim commits between the two reads
                        creating.append(asyncio.get_running_loop().create_task(cluster.claim(pool)))
                        await committed.wait()
                return rows

            cluster.client.get_prefix, cluster.client.transaction = racing_read, slow_answer
            await cluster.refresh()
            assert len(reads) == 2
            orphans = cluster.view.orphans()
            answered.set()
            claim = await creating[0]
            cluster.client.get_prefix, cluster.client.transaction = plain, plain_tx
            assert claim is not None and cluster.view.holds(pool)
            assert pool not in orphans, "the replica's own new pool was taken for an orphan"
        finally:
            await cluster.stop()

    asyncio.run(run())
