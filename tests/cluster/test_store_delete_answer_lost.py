"""A DeletePool whose delete in the cluster store (journal = "store": claim, catalog and
journal; ClusterStore.forget, or delete_unclaimed for a pool nobody serves) is carried
out by etcd while its answer is lost: the replica sees a timeout.

It was answered INTERNAL (a client cannot tell it from a bug, and took its outcome for
known), and the pool stayed held and served here from a claim the store no longer had
(until the watch's next pass). Now the store is read at once: the pool is gone from the
cluster, so the copy here goes too and the delete is answered. When the store cannot be
read either (a proxy that drops etcd's answers, then cuts), the call is answered
UNAVAILABLE (the client: OutcomeUnknownError), and its retry converges (the pool is
deleted, here and in the store, never served again). A delete held on its way and
carried out late never deletes the pool made again since (it names the claim's term;
with local journals, where the pool is made again under the claim the delete named,
that claim is put again first).

With local journals, a retried DeletePool also releases what a failed release left in
the store. An AdoptPool whose claim swap's answer is lost is UNAVAILABLE (was INTERNAL)
and the watch settles it.

A real replica (journal = "store", or "local"; real gRPC, the asyncio client) and a
real etcd."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aetcd import exceptions as aetcd_exceptions  # type: ignore[import-untyped]
from durable_server import free_port
from etcd_process import Etcd
from kvcoord.client import AsyncKVCoordClient, NotFoundError, OutcomeUnknownError, UnavailableError
from kvcoord.service.cluster import Cluster
from kvcoord.service.cluster_store import prefix_range
from kvcoord.service.config import ServerConfig, parse_config
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from replica_here import TRIES, owned_by_a_gone_replica, replica_here, store_reader, unclaimed_in_catalog
from service.helpers import allocate
from tcp_proxy import Proxy
from test_replicas import POOL_CONFIG, in_process_store_replica

#: no lease ends while a test holds the store away
LEASE = 30


def _is_delete(kw: dict[str, Any], keys: set[bytes], unclaimed: bool) -> bool:
    """The transaction ``kw`` is a delete of a pool in the store: forget (compared on
    its claim only: four deletes), or with ``unclaimed`` delete_unclaimed (compared on
    its claim and its catalog entry)."""
    compare = {c.key for c in kw.get("compare", [])}
    return compare == keys and (unclaimed or len(kw.get("success", [])) == 4)


def _forget_answer_lost(
    proxy: Proxy, cluster: Cluster, pool: str, seen: list[int], unclaimed: bool = False
) -> Callable[..., Awaitable[Any]]:
    """The replica's store transactions, the first delete of ``pool`` in the store among
    them (:func:`_is_delete`) reaching etcd, which carries it out, while its answer is
    dropped; then every connection is cut (the stream of answers is broken) and new
    ones refused until the test heals the proxy."""
    plain = cluster.client.transaction
    keys = {cluster.key("owners", pool)} | ({cluster.key("pools", pool)} if unclaimed else set())

    async def tx(*a: Any, **kw: Any) -> Any:
        if not _is_delete(kw, keys, unclaimed) or seen:
            return await plain(*a, **kw)
        seen.append(1)
        proxy.deafen()
        try:
            return await plain(*a, **kw)
        finally:
            proxy.hear()
            proxy.cut()

    return tx


async def _left_in_store(other: Any, cluster: Cluster, pool: str) -> list[bytes]:
    """The keys of ``pool`` the store still has: claim, catalog, last holder, journal."""
    keys = [cluster.key(kind, pool) for kind in ("owners", "pools", "last")]
    left = [k for k in keys if await other.get(k) is not None]
    assert cluster.streams is not None
    start, end = prefix_range(cluster.streams.pool_prefix(pool))
    rows = await other.get_range(start, end)
    return left + [kv.key for kv in rows]


def test_a_delete_whose_store_answer_was_lost_is_settled_and_the_copy_here_removed(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """etcd carries the delete out and the replica hears a timeout (a wrapper of the
    real client: the transaction is made, then DEADLINE_EXCEEDED raised); the store
    answers the read after it."""
    name = request.node.name[:40]
    address, cfg = in_process_store_replica(etcd.endpoint, name, tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster):
            plain = cluster.client.transaction
            keys = {cluster.key("owners", "d")}
            seen: list[int] = []

            async def tx(**kw: Any) -> Any:
                answer = await plain(**kw)
                if _is_delete(kw, keys, False) and not seen:
                    seen.append(1)  # made in etcd; its answer lost
                    raise aetcd_exceptions.ConnectionTimeoutError("Deadline Exceeded")
                return answer

            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                await c.create_pool("d", POOL_CONFIG)
                cluster.client.transaction = tx
                # (was: InternalError, the pool still held and served here)
                await c.delete_pool("d")
                assert seen == [1], "the delete in the store was not the one whose answer was lost"
                assert "d" not in running.servicer.registry.pools
                assert await _left_in_store(cluster.client, cluster, "d") == []
                with pytest.raises(NotFoundError):
                    await c.get_pool("d")

    asyncio.run(run())


def test_a_delete_whose_answer_was_lost_and_store_unread_is_outcome_unknown_and_converges(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    name = request.node.name[:40]
    proxy = Proxy(etcd.endpoint)
    address, cfg = in_process_store_replica(proxy.address, name, tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster), store_reader(etcd.endpoint) as other:
            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                await c.create_pool("d", POOL_CONFIG)
                seen: list[int] = []
                cluster.client.transaction = _forget_answer_lost(proxy, cluster, "d", seen)
                # the store cannot be read after the lost answer either: the outcome is
                # unknown (was: InternalError, which the client took for a known failure)
                with pytest.raises(OutcomeUnknownError):
                    await c.delete_pool("d")
                assert seen == [1]
                assert await _left_in_store(other, cluster, "d") == [], "etcd did not carry the delete out"
                proxy.heal()
                for _ in range(TRIES):  # bounded: the retry converges once the store answers
                    try:
                        await c.delete_pool("d")
                        break
                    except NotFoundError:  # (the watch's pass settled it first)
                        break
                    except UnavailableError:
                        await asyncio.sleep(0.5)
                else:
                    pytest.fail(f"the retried delete did not converge within {TRIES} attempts")
                assert "d" not in running.servicer.registry.pools
                with pytest.raises(NotFoundError):
                    await c.get_pool("d")
                assert await _left_in_store(other, cluster, "d") == []

    try:
        asyncio.run(run())
    finally:
        proxy.close()


def test_a_delete_of_a_pool_nobody_serves_whose_answer_was_lost_is_outcome_unknown(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A pool of the catalog nobody claims (its owner stopped without handing it over),
    placed here: DeletePool deletes it in the store (delete_unclaimed), etcd does it,
    the answer is lost. UNAVAILABLE (OutcomeUnknownError; was INTERNAL), and the retry
    finds no such pool."""
    name = request.node.name[:40]
    proxy = Proxy(etcd.endpoint)
    address, cfg = in_process_store_replica(proxy.address, name, tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster), store_reader(etcd.endpoint) as other:
            await unclaimed_in_catalog(other, cluster, "gone")
            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                seen: list[int] = []
                cluster.client.transaction = _forget_answer_lost(proxy, cluster, "gone", seen, True)
                with pytest.raises(OutcomeUnknownError):  # (was: InternalError)
                    await c.delete_pool("gone")
                assert seen == [1]
                assert await _left_in_store(other, cluster, "gone") == [], "etcd did not carry the delete out"
                proxy.heal()
                for _ in range(TRIES):  # bounded: the watch re-reads the catalog
                    try:
                        await c.delete_pool("gone")
                    except NotFoundError:
                        break
                    except UnavailableError:
                        await asyncio.sleep(0.5)
                else:
                    pytest.fail(f"the retried delete did not find the pool gone within {TRIES} attempts")

    try:
        asyncio.run(run())
    finally:
        proxy.close()


def test_a_delete_landing_late_in_the_store_leaves_the_pool_made_again_since(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """DeletePool's delete in the store (forget) is held on its way and the replica
    hears nothing (its outcome unknown: OutcomeUnknownError); the retried DeletePool
    deletes the pool, CreatePool makes it again here (a new claim), a session allocates
    in it (acknowledged: in its journal in the store). Then etcd carries the first
    delete out, late. It was compared on the claim's value, the same for every claim of
    this replica: it deleted the new pool's claim, catalog entry and journal, every
    acknowledged allocation in it with them. Compared on the term it named, it changes
    nothing, and the pool is served on."""
    name = request.node.name[:40]
    address, cfg = in_process_store_replica(etcd.endpoint, name, tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster):
            plain = cluster.client.transaction
            owners = cluster.key("owners", "d")
            held: list[dict[str, Any]] = []

            async def tx(**kw: Any) -> Any:
                if not held and _is_delete(kw, {owners}, False):
                    held.append(kw)  # forget (4 deletes): on its way, no answer for now
                    raise aetcd_exceptions.ConnectionTimeoutError("Deadline Exceeded")
                return await plain(**kw)

            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                await c.create_pool("d", POOL_CONFIG)
                first_term = cluster.view.term("d")
                cluster.client.transaction = tx
                with pytest.raises(OutcomeUnknownError):
                    await c.delete_pool("d")
                assert len(held) == 1
                await c.delete_pool("d")  # the retry: deleted
                assert await _left_in_store(cluster.client, cluster, "d") == []
                await c.create_pool("d", POOL_CONFIG)
                assert cluster.view.term("d") > first_term
                s = await c.attach("d", "sha256_cbor", 4, "0", lease_seconds=120)
                got = await c.allocate("d", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
                blocks = list(got.result.new_block_ids[0].block_ids)
                assert blocks
                journal = await _left_in_store(cluster.client, cluster, "d")

                ok, _ = await plain(**held[0])  # the first delete, carried out late
                assert not ok, "the late delete of the first pool deleted the pool made again since"
                assert await _left_in_store(cluster.client, cluster, "d") == journal
                got = await c.allocate(
                    "d", allocate("b", list(range(50, 58)), 8).allocate, s.session_id, s.fence
                )
                view = await c.inspect_pool("d", all_requests=True)
                assert {r.request_id: list(r.groups[0].block_ids) for r in view.requests}["a"] == blocks

    asyncio.run(run())


def _local_replica(etcd: Etcd, name: str, data_dir: Path) -> tuple[str, ServerConfig]:
    """The address and config of a replica r0 started in the test's process, journal = "local"."""
    address = f"127.0.0.1:{free_port()}"
    cfg = parse_config(
        f'[server]\nlisten = ["{address}"]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\n'
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{name}"\nreplica_id = "r0"\n'
        f'lease_seconds = {LEASE}\nstore_timeout_seconds = 2.0\njournal = "local"\n'
    )
    return address, cfg


def test_a_release_landing_late_leaves_the_pool_made_again_under_local_journals(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """journal = "local": DeletePool removes the pool here, then releases its claim and
    catalog entry in the store (after_delete: forget); that release is held on its way
    (OutcomeUnknownError). CreatePool makes the pool again here: the claim held here
    was the old one, and the pool was made under it, so the late release, naming that
    claim, deleted the new pool's claim and catalog entry while it was served here
    (another replica could claim and create it: two live copies). The claim is put
    again first (a new revision): the late release changes nothing."""
    address, cfg = _local_replica(etcd, request.node.name[:40], tmp_path)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster):
            plain = cluster.client.transaction
            owners = cluster.key("owners", "d")
            held: list[dict[str, Any]] = []

            async def tx(**kw: Any) -> Any:
                compare = {c.key for c in kw.get("compare", [])}
                if (
                    not held
                    and compare == {owners}
                    and len(kw.get("success", [])) == 3
                    and not kw.get("failure")
                ):
                    held.append(kw)  # forget (3 deletes, no journal in the store): on its way, no answer
                    raise aetcd_exceptions.ConnectionTimeoutError("Deadline Exceeded")
                return await plain(**kw)

            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                await c.create_pool("d", POOL_CONFIG)
                cluster.client.transaction = tx
                with pytest.raises(OutcomeUnknownError):
                    await c.delete_pool("d")
                assert len(held) == 1 and "d" not in running.servicer.registry.pools
                await c.create_pool("d", POOL_CONFIG)
                s = await c.attach("d", "sha256_cbor", 4, "0", lease_seconds=120)
                await c.allocate("d", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
                claim = await cluster.client.get(owners)
                assert claim is not None

                ok, _ = await plain(**held[0])  # the release, carried out late
                assert not ok, "the late release of the deleted pool released the pool made again since"
                after = await cluster.client.get(owners)
                assert after is not None and after.mod_revision == claim.mod_revision
                assert await cluster.client.get(cluster.key("pools", "d")) is not None

    asyncio.run(run())


def test_a_release_that_failed_under_local_journals_is_made_by_the_retried_delete(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """journal = "local": DeletePool removes the pool here, then its release in the store
    (claim and catalog entry) fails before it was sent (a connection refused):
    OutcomeUnknownError. The retried DeletePool is NOT_FOUND (the pool is gone), and it
    releases what the store kept: was left there for good (the claim with this
    replica's lease; the catalog entry without one: once the replica restarted, the
    pool was one nobody claims, OWNER_CHANGING, and DeletePool OWNER_GONE)."""
    address, cfg = _local_replica(etcd, request.node.name[:40], tmp_path)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster):
            plain = cluster.client.transaction
            owners, catalog = cluster.key("owners", "d"), cluster.key("pools", "d")
            failed: list[int] = []

            async def tx(**kw: Any) -> Any:
                compare = {c.key for c in kw.get("compare", [])}
                if (
                    not failed
                    and compare == {owners}
                    and len(kw.get("success", [])) == 3
                    and not kw.get("failure")
                ):
                    failed.append(1)  # forget, never sent
                    raise aetcd_exceptions.ConnectionFailedError("failed to connect to all addresses")
                return await plain(**kw)

            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                await c.create_pool("d", POOL_CONFIG)
                cluster.client.transaction = tx
                with pytest.raises(OutcomeUnknownError):
                    await c.delete_pool("d")
                assert failed == [1] and "d" not in running.servicer.registry.pools
                assert await cluster.client.get(owners) is not None
                assert await cluster.client.get(catalog) is not None
                with pytest.raises(NotFoundError):
                    await c.delete_pool("d")
                assert await cluster.client.get(owners) is None, "the claim of the deleted pool is kept"
                assert await cluster.client.get(catalog) is None, "the deleted pool is kept in the catalog"
                with pytest.raises(NotFoundError):
                    await c.get_pool("d")

    asyncio.run(run())


def test_an_adopt_whose_claim_swap_answer_was_lost_is_unavailable_and_settled(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """AdoptPool (a handover's new owner): the state is loaded and journaled, then the
    claim swapped from the sender to this replica (take_over); etcd makes the swap and
    its answer is lost. The call was answered INTERNAL; it is UNAVAILABLE now (the
    sender settles its handover as for any failure), and the watch's next pass finds the
    claim this replica's: the pool, whose state is here, is served."""
    address, cfg = in_process_store_replica(etcd.endpoint, request.node.name[:40], tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster):
            plain = cluster.client.transaction
            owners = cluster.key("owners", "a")
            lost: list[int] = []

            async def tx(**kw: Any) -> Any:
                answer = await plain(**kw)
                swap = {c.key for c in kw.get("compare", [])} == {owners} and len(kw.get("success", [])) == 2
                if swap and not lost:
                    lost.append(1)  # made in etcd; its answer lost
                    raise aetcd_exceptions.ConnectionTimeoutError("Deadline Exceeded")
                return answer

            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                adopt = await owned_by_a_gone_replica(c, running, cluster, "a")
            cluster.client.transaction = tx
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await pb_grpc.ReplicasStub(channel).AdoptPool(adopt, timeout=20)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value  # (was: INTERNAL)
            assert lost == [1]
            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                for _ in range(TRIES):  # bounded: the watch's next pass reads the claim
                    try:
                        assert (await c.get_pool("a")).pool.name == "a"
                        break
                    except UnavailableError:
                        await asyncio.sleep(0.5)
                else:
                    pytest.fail(f"the adopted pool was not served within {TRIES} attempts")
            assert cluster.view.holds("a")

    asyncio.run(run())
