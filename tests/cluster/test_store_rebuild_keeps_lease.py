"""A pool rebuilt from the cluster store (``journal = "store"``) whose rebuild outlasts
the rebuilding replica's cluster lease.

The pool's owner (a real replica process) is SIGKILLed; the replica placement names
next (in the test's process, real gRPC, real etcd) claims the pool and rebuilds it. The
rebuild is made slow by a hook of this test only: store_rebuild.rebuild followed by
two leases (or more) of CPU-bound Python (a large pool's replay at a CPU quota holds the CPU
so: 65,536 blocks took 4.6 s at 6 %). The rebuild ran on the event loop: the replica's
keep-alive could not renew its lease, the lease ended and the claim with it, the pool
was found unclaimed, claimed and rebuilt again, never served (seen: 11 claims in 2
minutes); and every call of the replica's other pools waited for it.

What must hold: a call of the replica's other pool is answered while the rebuild runs;
the replica never registers again (its lease held throughout); the pool is claimed
once, rebuilt once and served under that claim, with every allocation its old owner
acknowledged. And: a claim lost during the rebuild is not loaded; a stop during the
rebuild ends it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, AsyncKVCoordClient, UnavailableError
from kvcoord.client.testing import start_server
from kvcoord.service import state_export, store_rebuild
from kvcoord.service.ownership import encode_claim
from replica_here import TRIES, replica_here
from service.helpers import allocate
from test_replicas import POOL_CONFIG, in_process_store_replica, placed

#: r0's cluster lease: the rebuild lasts two of them (at 3 s, one run in 8 lost it at
#: load 14 on 2 cores, the rebuilding child spinning on one of them; at load 24 a 4 s
#: lease was lost before any rebuild, the loop not run for up to 2.5 s at a time)
LEASE = 6
SLOW_SECONDS = 2 * LEASE
#: the old owner's lease (its claim ends this long after it is killed)
OLD_LEASE = 3
#: r0's lease when the rebuild runs on a thread: outlasts it
THREAD_LEASE = 4 * SLOW_SECONDS
#: the longest a slowed rebuild the test does not let end runs
HELD_AT_MOST = 120.0


def _slowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, big: str, seconds: float = SLOW_SECONDS
) -> tuple[Path, Path, Path]:
    """store_rebuild.rebuild of ``big`` followed by CPU-bound Python for ``seconds`` at
    least, and then until the test lets it end (the third file returned is made; at most
    :data:`HELD_AT_MOST` seconds: a test that fails never hangs). The first file is made
    as that starts (holding the pid it runs in), the second once it ends (files: the
    rebuild may run in a forked child)."""
    started, ended, may_end = tmp_path / "rebuild started", tmp_path / "rebuild ended", tmp_path / "may end"
    plain = store_rebuild.rebuild

    def slow(streams: Any, make_registry: Any, pool: str, *rest: Any) -> Any:
        out = plain(streams, make_registry, pool, *rest)
        if pool == big:
            started.write_text(str(os.getpid()))
            begun = time.monotonic()
            # CPU-bound (on a thread: the GIL let go only at switches)
            while (time.monotonic() - begun < seconds or not may_end.exists()) and (
                time.monotonic() - begun < HELD_AT_MOST
            ):
                pass
            ended.touch()
        return out

    monkeypatch.setattr(store_rebuild, "rebuild", slow)
    return started, ended, may_end


async def _rebuilding(
    etcd: Etcd, name: str, tmp_path: Path, r0: str, big: str, other: str, started: Path
) -> dict[str, list[int]]:
    """The old owner started, ``big`` and ``other`` made and ``big`` allocated in, the
    old owner SIGKILLed, and r0 (in this process) rebuilding ``big`` (``started``)."""
    old = start_server(_old_owner(etcd, name, tmp_path / "old"), env=env())
    try:
        acked = await _allocated_at_the_old_owner(old.address, r0, big, other)
        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait(30)
    finally:
        old.stop()
    for _ in range(4 * TRIES):  # bounded: the old owner's lease ends, r0 claims big
        if started.exists():
            break
        await asyncio.sleep(0.25)
    assert started.exists(), "r0 never rebuilt the pool"
    return acked


def _replica_and_pools(
    etcd: Etcd, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lease: int = LEASE
) -> tuple[str, Any, str, str, Path, Path, Path]:
    """r0's address and config (cluster ``name``, r0's lease ``lease``), the pool ``big``
    (the old owner's, r0's once it is gone) and the pool ``other`` (r0's), and the files
    of the rebuild of ``big`` made slow (:func:`_slowed`)."""
    address, cfg = in_process_store_replica(etcd.endpoint, name, tmp_path / "r0", lease)
    big = placed("big", "old", ["r0", "old"])
    other = placed("other", "r0", ["r0", "old"])
    return address, cfg, big, other, *_slowed(monkeypatch, tmp_path, big)


def _old_owner(etcd: Etcd, name: str, data_dir: Path) -> str:
    return (
        f'[server]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\n'
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{name}"\nreplica_id = "old"\n'
        f'lease_seconds = {OLD_LEASE}\nstore_timeout_seconds = 1.0\njournal = "store"\n'
    )


@pytest.mark.long
@pytest.mark.parametrize(("where", "lease"), [("forked", LEASE), ("on a thread", THREAD_LEASE)])
def test_a_rebuild_longer_than_the_lease_keeps_the_lease_and_serves_the_other_pools(
    etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, lease: int
) -> None:
    """``where`` the rebuild runs: a forked child, or (a process that may not fork) a
    thread of the replica's. r0's lease is ``lease``: on a thread the rebuild shares the
    GIL with the loop, and a loaded machine that preempts it while it holds the GIL
    holds the loop (its lease was lost at load 6 on 2 cores): there it is checked for
    what it keeps (the other pool's calls, one claim, the blocks) with a lease that
    outlasts it."""
    name = f"rebuild-keeps-lease-{where.replace(' ', '-')}"  # (a cluster of its own per case)
    address, cfg, big, other, started, ended, may_end = _replica_and_pools(
        etcd, name, tmp_path, monkeypatch, lease
    )
    if where == "on a thread":
        monkeypatch.setattr(state_export, "_forkable", lambda: False)

    async def run() -> None:
        async with replica_here(cfg) as (_, cluster):
            registered, claims = [], []
            plain_register, plain_claim = cluster.register, cluster.claim

            async def register() -> None:
                registered.append(1)
                await plain_register()

            async def claim(pool: str, own_copy: bool = False) -> Any:
                got = await plain_claim(pool, own_copy)
                if pool == big and got is not None:
                    claims.append(got.term)
                return got

            cluster.register = register  # type: ignore[method-assign]
            cluster.claim = claim  # type: ignore[method-assign]
            acked = await _rebuilding(etcd, name, tmp_path, address, big, other, started)
            async with AsyncKVCoordClient(address, timeout=10.0, retry=NO_RETRY) as c:
                s = await c.attach(other, "sha256_cbor", 4, "0", lease_seconds=60)
                got = await c.allocate(other, allocate("o2", [9] * 8, 8).allocate, s.session_id, s.fence)
                assert not got.result.refused
                assert not ended.exists(), "a call of another pool waited for the whole rebuild"
                may_end.touch()
            view = None
            async with AsyncKVCoordClient(address, timeout=10.0) as c:
                for _ in range(4 * TRIES):  # bounded: the rebuild ends, the pool is served
                    try:
                        view = await c.inspect_pool(big, all_requests=True)
                        break
                    except UnavailableError:  # changing owner: being rebuilt
                        await asyncio.sleep(0.25)
            assert view is not None, "the rebuilt pool was never served"
            assert {r.request_id: list(r.groups[0].block_ids) for r in view.requests} == acked
            assert registered == [], "the replica lost its lease during the rebuild and registered again"
            assert len(claims) == 1 and cluster.failovers == 1, (claims, cluster.failovers)
            assert cluster.view.holds(big) and cluster.view.term(big) == claims[0]
            assert (int(started.read_text()) == os.getpid()) == (where == "on a thread")  # where it ran

    asyncio.run(run())


async def _allocated_at_the_old_owner(old: str, r0: str, big: str, other: str) -> dict[str, list[int]]:
    """Both pools made (``big`` at the old owner, ``other`` at r0) and allocations in
    ``big`` acknowledged by the old owner: request id -> its blocks."""
    acked: dict[str, list[int]] = {}
    async with AsyncKVCoordClient([old, r0], timeout=10.0) as c:
        await c.create_pool(big, POOL_CONFIG)
        await c.create_pool(other, POOL_CONFIG)
        s = await c.attach(big, "sha256_cbor", 4, "0", lease_seconds=60)
        for n in range(4):
            tokens = list(range(n * 100, n * 100 + 12))
            got = await c.allocate(
                big, allocate(f"a{n}", tokens, len(tokens)).allocate, s.session_id, s.fence
            )
            assert not got.result.refused
            acked[f"a{n}"] = list(got.result.new_block_ids[0].block_ids)
        listed = {p.name: p.replica for p in (await c.list_pools()).pools}
        assert listed.get(big) == "old" and listed.get(other) == "r0", listed
    return acked


@pytest.mark.long
def test_a_claim_lost_during_the_rebuild_is_not_served(
    etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """While r0 rebuilds the pool, its claim goes to another replica (written to etcd as
    a replica's claim: r9, a new revision). The state rebuilt for the claim that ended
    is never loaded: not served at a term that is gone (was: loaded, and served at it
    until its first write to the store, compared on the claim, failed: the pool was
    then removed and the watch's pass raised)."""
    name = "rebuild-claim-lost"
    address, cfg, big, other, started, ended, may_end = _replica_and_pools(etcd, name, tmp_path, monkeypatch)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster):
            loaded, plain_load = [], cluster.load_pool
            assert plain_load is not None

            async def load(value: dict[str, Any], term: int) -> None:
                loaded.append(term)
                await plain_load(value, term)

            cluster.load_pool = load
            await _rebuilding(etcd, name, tmp_path, address, big, other, started)
            assert big in cluster.adopting
            await cluster.client.put(cluster.key("owners", big), encode_claim("r9", "127.0.0.1:9"))
            may_end.touch()
            for _ in range(4 * TRIES):  # bounded: the rebuild ends, and what follows it
                if ended.exists() and big not in cluster.adopting:
                    break
                await asyncio.sleep(0.25)
            assert ended.exists() and big not in cluster.adopting
            assert loaded == [], "the state rebuilt for a claim that ended was loaded"
            assert big not in running.servicer.registry.pools and cluster.failovers == 0
            assert f"pool {big} was rebuilt from the cluster store for its claim at term" in caplog.text

    asyncio.run(run())


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended (gone, or a zombie not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_stop_during_a_rebuild_ends_it(etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica stops (grace 0: its pools' claims go with its lease) while it
    rebuilds a pool in a forked child: the stop does not wait for the rebuild, and the
    child is ended with it (killed, never finishing)."""
    name = "rebuild-stopped"
    address, cfg, big, other, started, ended, _ = _replica_and_pools(etcd, name, tmp_path, monkeypatch)

    async def run() -> int:
        async with replica_here(cfg) as (_, cluster):
            await _rebuilding(etcd, name, tmp_path, address, big, other, started)
            assert big in cluster.adopting
        return int(started.read_text())

    child = asyncio.run(run())
    assert child != os.getpid() and not ended.exists(), "the stop waited for the rebuild"
    for _ in range(TRIES):  # bounded: the child is killed and reaped
        if _gone(child):
            break
        time.sleep(0.5)
    assert _gone(child) and not ended.exists()
