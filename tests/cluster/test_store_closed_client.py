"""A store client the replica closed (a client replaced by ClusterStore.reconnect and
retired, or the one a stopping replica closes) never carries a call again. aetcd
connects anew for any call made on a closed client: a new channel, to the endpoint the
replica left, that nothing ever closes; a code path still holding the old client would
go on talking to the store through it unseen. Such a call now fails at once
(ConnectionFailedError, a store failure its caller retries on the client in use) and
opens nothing. A real etcd."""

from __future__ import annotations

import asyncio

import pytest
from aetcd import exceptions  # type: ignore[import-untyped]
from etcd_process import Etcd
from kvcoord.service import cluster_store
from kvcoord.service.cluster import Cluster
from kvcoord.service.ownership import Member

#: the store calls' deadline (a bound, not a measurement)
TIMEOUT = 5.0


def test_a_call_on_a_closed_client_fails_and_opens_no_channel(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    key = f"/kvcoord/{request.node.name[:40]}/k".encode()

    async def run() -> None:
        client = cluster_store.store_client(etcd.endpoint, TIMEOUT)
        await client.connect()
        await client.put(key, b"v")
        await cluster_store.close_client(client, TIMEOUT)
        assert client.channel is None
        with pytest.raises(exceptions.ConnectionFailedError):  # (was: answered, on a new channel)
            await client.get(key)
        assert client.channel is None, "a channel was opened for a call on the closed client"

    asyncio.run(run())


def test_a_client_replaced_and_retired_carries_no_call_again(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    name = request.node.name[:40]

    async def run() -> None:
        cluster = Cluster([etcd.endpoint], name, Member("r0", "127.0.0.1:1"), 30, 0.2)
        await cluster.connect()
        old = cluster.client
        try:
            assert await cluster.reconnect()
            assert cluster.client is not old
            await asyncio.wait(set(cluster.retired), timeout=30.0)  # closed once its calls' deadline passed
            assert not cluster.retired and old.channel is None
            with pytest.raises(exceptions.ConnectionFailedError):
                await old.get(cluster.key("members", "r0"))
            assert old.channel is None
            assert await cluster.client.get(cluster.key("members", "r0")) is None  # the new one serves
        finally:
            await cluster.stop()

    asyncio.run(run())
