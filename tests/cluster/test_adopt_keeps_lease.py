"""A pool loaded by a replica (a handover's ``AdoptPool``; a takeover from the cluster
store) while the replica serves another pool.

Loading such a pool decoded its state, built its engine and encoded the state again
for the journal, all on the replica's event loop: about 6.5 s for 1,048,576 blocks on
an idle core (1.1 s for 262,144; deploy/README.md). Meanwhile the replica renewed no
cluster lease and answered no call: its lease ended, the replica registered again, and
calls of its other pools were told it could not reach the cluster store.

How long a build takes depends on the machine, so the tests do not rely on a large
pool's time: the large pool's engine build (``pool_service.import_state``, called on the
loop before and on the loading thread now) is held until the replica has answered
:data:`ANSWERED` calls of another pool after the build began, for at most
:data:`GATE_SECONDS` (longer than the lease). On the loop, nothing is answered while
it is held: the build is released by the bound alone, the lease is lost meanwhile.

Real etcd, the replica in the test's process (real gRPC); the pool's state is made in
the test's process by a pool of its own (the state a handover sends, or a base in the
cluster store a dead owner left). What must hold while the replica loads it: calls of
another pool are answered while its engine is built, its lease is kept (never
registered again, never unsure of it), every call of the other pool made meanwhile is
answered, and the pool it loads is then served with every request's blocks as its state
had them."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import cbor2
import grpc
import pytest
from durable_server import free_port
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, AsyncKVCoordClient, UnavailableError
from kvcoord.service import operations as op
from kvcoord.service import pool_service
from kvcoord.service.cluster import Cluster
from kvcoord.service.config import ServerConfig, parse_config
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.ownership import encode_claim
from kvcoord.service.registry import Limits, PoolRegistry
from kvcoord.service.registry_state import dump_pool, journaled_limits
from kvcoord.service.sessions import SessionTable
from kvcoord.service.store_journal import PART_BYTES, encode_base
from kvcoord.service.testing import ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from replica_here import TRIES, replica_here
from service.helpers import allocate
from test_replicas import POOL_CONFIG

#: the loaded pool's blocks (its engine's build is held by the gate, not made long by size)
BLOCKS = 1 << 14
#: blocks per request filling it (every other one freed: cached, not held)
REQUEST_BLOCKS = 256
#: calls of the other pool the replica answers while the loaded pool's engine is built
ANSWERED = 3
#: the longest the gate holds the build (seconds): past the lease, so that a build on the
#: replica's loop costs the lease
GATE_SECONDS = 15.0
#: the replica's cluster lease (at load 30 on 2 cores the replica's other work alone held
#: its loop 1-2 s at a time)
LEASE = 6
#: how long the replica's journal commit may take (a loaded machine's commits outlasted
#: the default 10 s: the replica then stops serving, not what is tested here)
JOURNAL_STALL = 25


class _Gate:
    """Holds the loaded pool's engine build (``pool_service.import_state`` for a config of
    :data:`BLOCKS` blocks, in this process: a forked rebuild child passes) until
    :meth:`answered` was called :data:`ANSWERED` times after the build began, or for
    :data:`GATE_SECONDS`; :attr:`released` says, per build, which ended the wait."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.began = threading.Event()
        self.enough = threading.Event()
        self.count = 0
        self.released: list[bool] = []
        pid, build = os.getpid(), pool_service.import_state

        def held(config: object, value: object) -> object:
            if os.getpid() == pid and getattr(config, "num_blocks", 0) == BLOCKS:
                self.began.set()
                self.released.append(self.enough.wait(GATE_SECONDS))
            return build(config, value)  # type: ignore[arg-type]

        monkeypatch.setattr(pool_service, "import_state", held)

    def answered(self) -> None:
        """A call of another pool was answered."""
        if self.began.is_set():
            self.count += 1
            if self.count >= ANSWERED:
                self.enough.set()


BIG_CONFIG = pb.PoolConfig(
    num_blocks=BLOCKS, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
    groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
)  # fmt: skip


def _config(endpoint: str, name: str, data_dir: Path) -> tuple[str, ServerConfig]:
    """Replica r0 (journal = "store", lease :data:`LEASE`), taking messages of a large
    pool's state."""
    address = f"127.0.0.1:{free_port()}"
    cfg = parse_config(
        f'[server]\nlisten = ["{address}"]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\n'
        f"grace_seconds = 10\nmax_message_bytes = {1 << 30}\njournal_stall_seconds = {JOURNAL_STALL}\n"
        f'[cluster]\nendpoints = ["{endpoint}"]\nname = "{name}"\nreplica_id = "r0"\n'
        f'lease_seconds = {LEASE}\nstore_timeout_seconds = 2.0\njournal = "store"\n'
    )
    return address, cfg


def _large_pool(name: str) -> tuple[PoolRegistry, dict[str, list[int]]]:
    """A registry of the test's own (instance "gone") holding pool ``name`` of
    :data:`BLOCKS` blocks, every one built, and its live requests' blocks."""
    clock = ManualClock()
    registry = PoolRegistry(Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 300.0, 1 << 20),
                            "gone", clock=clock)  # fmt: skip
    registry.create(name, BIG_CONFIG)
    service = registry.pools[name]
    s = service.attach("sha256_cbor", 4, "0", "filler", 0)
    for n in range((BLOCKS - 1) // REQUEST_BLOCKS):
        tokens = [n % 30000] * (REQUEST_BLOCKS * 4)
        sync = op.RequestSync(
            f"r{n}", tokens, [os.urandom(32) for _ in range(REQUEST_BLOCKS)], new_request=True
        )
        (got,) = service.apply(s, [op.Allocate(sync, len(tokens))])
        assert got.error is None, got.error
        if n % 2:
            service.apply(s, [op.Free(f"r{n}")])
    held = {
        rid: [b.block_id for b in blocks] for rid, blocks in service.engine.managers[0].req_to_blocks.items()
    }
    assert len(held) == len(range(0, (BLOCKS - 1) // REQUEST_BLOCKS, 2)) and all(
        len(b) == REQUEST_BLOCKS for b in held.values()
    )
    return registry, held


async def _while_loading(
    address: str, cluster: Cluster, load: Callable[[], Awaitable[None]], gate: _Gate
) -> tuple[list[str], list[int], float]:
    """Run ``load`` while a client allocates in another pool of the replica, one call at
    a time (no retry), and the replica's lease is watched. Returns the errors those
    calls got, the registrations the replica made meanwhile, and the longest the
    replica's loop stood still (a tick every 10 ms; for the message only)."""
    errors: list[str] = []
    registered: list[int] = []
    plain_register = cluster.register

    async def register() -> None:
        registered.append(1)
        await plain_register()

    cluster.register = register  # type: ignore[method-assign]
    done = asyncio.Event()
    longest = 0.0

    async def ticks() -> None:
        nonlocal longest
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            longest = max(longest, now - last - 0.01)
            if not cluster.view.lease_valid:
                errors.append("the replica was unsure of its cluster lease")
            last = now

    async def other_pool() -> None:
        async with AsyncKVCoordClient(address, timeout=30.0, retry=NO_RETRY) as c:
            await c.create_pool("other", POOL_CONFIG)
            s = await c.attach("other", "sha256_cbor", 4, "0", lease_seconds=60)
            n = 0
            while not done.is_set():
                try:
                    got = await c.allocate(
                        "other", allocate(f"o{n}", [n] * 4, 4).allocate, s.session_id, s.fence
                    )
                    assert not got.result.refused
                    await c.free("other", [f"o{n}"], session_id=s.session_id, fence=s.fence)
                    gate.answered()
                except Exception as exc:  # noqa: BLE001 - what the test reports
                    errors.append(f"call {n}: {exc!r:.300}")
                n += 1
                await asyncio.sleep(0.05)

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(ticks()), loop.create_task(other_pool())]
    await asyncio.sleep(1.0)  # the other pool made, its calls going on
    try:
        await load()
    finally:
        done.set()
        await asyncio.gather(*tasks)
        cluster.register = plain_register  # type: ignore[method-assign]
    return errors, registered, longest


async def _served(address: str, pool: str) -> dict[str, list[int]]:
    """The requests ``pool`` holds at ``address`` once it is served (bounded wait)."""
    async with AsyncKVCoordClient(address, timeout=30.0, max_message_bytes=1 << 30) as c:
        for _ in range(4 * TRIES):
            try:
                view = await c.inspect_pool(pool, all_requests=True)
                return {r.request_id: list(r.groups[0].block_ids) for r in view.requests}
            except UnavailableError:  # changing owner: being loaded
                await asyncio.sleep(0.25)
    raise AssertionError(f"pool {pool} was never served")


def test_a_pool_handed_over_is_loaded_while_the_replica_answers_and_keeps_its_lease(
    etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r0 adopts a pool (``AdoptPool``, as a handover's sender calls it: the pool's claim
    is a replica's that left the view)."""
    name, big = "large-adopt-handover", "big"
    address, cfg = _config(etcd.endpoint, name, tmp_path / "r0")
    registry, held = _large_pool(big)
    state = cbor2.dumps(dump_pool(registry, big, leases=True))
    del registry

    async def run() -> None:
        async with replica_here(cfg) as (_, cluster):
            await cluster.client.put(cluster.key("owners", big), encode_claim("gone", "127.0.0.1:9"))
            await cluster.client.put(cluster.key("pools", big), b"")
            await cluster.refresh()
            request = pb.AdoptPoolRequest(
                pool=big, state=state, from_replica="gone", claim_revision=cluster.view.term(big)
            )
            # (serialized on a thread: the test's sender shares the replica's loop)
            sent = await asyncio.to_thread(request.SerializeToString)
            del request

            async def adopt() -> None:
                options = [("grpc.max_send_message_length", -1)]
                async with grpc.aio.insecure_channel(address, options=options) as channel:
                    call = channel.unary_unary(
                        "/kvcoord.v1.Replicas/AdoptPool",
                        response_deserializer=pb.AdoptPoolResponse.FromString,
                    )
                    await call(sent, timeout=300)

            gate = _Gate(monkeypatch)
            errors, registered, longest = await _while_loading(address, cluster, adopt, gate)
            assert gate.released == [True], (
                f"no call of another pool was answered while the engine was built: {gate.released}"
            )
            assert errors == [] and registered == [], (errors[:5], len(errors), registered, longest)
            assert cluster.view.holds(big)
            assert await _served(address, big) == held

    asyncio.run(run())


async def _put_base(cluster: Cluster, registry: PoolRegistry, pool: str, term: int) -> None:
    """``pool``'s stream of ``term`` in the store: its base alone, as its owner (the
    registry's instance) wrote it before it died."""
    body = encode_base(
        dump_pool(registry, pool), registry.instance_id, journaled_limits(registry, registry.limits),
        time.time(), None,
    )  # fmt: skip
    assert cluster.streams is not None
    prefix = cluster.streams.pool_prefix(pool)
    parts = [body[i : i + PART_BYTES] for i in range(0, len(body), PART_BYTES)]
    for n, part in enumerate(parts):
        await cluster.client.put(prefix + f"{term}/0/{n}/{len(parts)}".encode(), part)


def test_a_pool_taken_over_from_the_store_is_loaded_while_the_replica_answers_and_keeps_its_lease(
    etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r0 takes over a pool whose owner is gone (in the catalog, unclaimed, its base in
    the store): rebuilt (a forked child), then loaded."""
    name, big = "large-adopt-takeover", "big"
    address, cfg = _config(etcd.endpoint, name, tmp_path / "r0")
    registry, held = _large_pool(big)

    async def run() -> None:
        async with replica_here(cfg) as (_, cluster):
            cluster._retry_at[big] = float("inf")  # not taken over before the test says so
            await _put_base(cluster, registry, big, 1)
            await cluster.client.put(cluster.key("pools", big), b"")
            for _ in range(TRIES):  # bounded: the watch reads it
                if big in cluster.view.orphans():
                    break
                await asyncio.sleep(0.5)
            assert big in cluster.view.orphans()

            async def take_over() -> None:
                cluster._retry_at.pop(big)
                assert await cluster.recover(big)

            gate = _Gate(monkeypatch)
            errors, registered, longest = await _while_loading(address, cluster, take_over, gate)
            assert gate.released == [True], (
                f"no call of another pool was answered while the engine was built: {gate.released}"
            )
            assert errors == [] and registered == [], (errors[:5], len(errors), registered, longest)
            assert cluster.view.holds(big) and cluster.failovers == 1
            assert await _served(address, big) == held

    asyncio.run(run())
