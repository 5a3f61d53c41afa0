"""What reads or changes every pool (ListPools, ScorePools, a metrics scrape, a stop's
final snapshot, a proven restore's deferred fencing: PoolLocks.wait_all) waits while a
pool is held by a Step applied in slices. Two such waiters on one held pool used to
take turns in its queue and hand it to each other forever: neither returned and the
pool stayed held (snapshots, the reaper and every later whole-server read waited with
them). They now return once the pool is given back."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, UnavailableError
from kvcoord.service.pool_locks import PoolLocks
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import calls_in_threads, pool_toml


def test_two_wait_alls_return_once_the_pool_is_given_back() -> None:
    async def main() -> bool:
        locks = PoolLocks()
        locks.take("p")  # as a Step applied in slices holds it
        a = asyncio.ensure_future(locks.wait_all())
        b = asyncio.ensure_future(locks.wait_all())
        await asyncio.sleep(0.01)
        locks.give("p")
        done, _ = await asyncio.wait([a, b], timeout=2)
        a.cancel()
        b.cancel()
        return len(done) == 2 and not locks.any_busy()

    assert asyncio.run(main()), "two wait_all() never returned: the pool is handed between them forever"


def test_two_list_pools_during_a_sliced_step(make_server: Callable[..., InProcessServer]) -> None:
    server = make_server(pool_toml("p", 64, caching=False))
    locks = server.running.servicer.registry.locks
    server.call(lambda: locks.take("p"))  # as a Step applied in slices holds it
    threads, out = calls_in_threads(server.address, lambda c: len(c.list_pools().pools), n=2, timeout=5)
    time.sleep(0.5)  # both wait for the pool
    server.call(lambda: locks.give("p"))  # the Step is done
    for t in threads:
        t.join(10)
    assert out == [1, 1], out


def _alloc(c: KVCoordClient, s: Any, rid: str, n: int) -> None:
    hashes = [f"{rid}-{i}".encode().ljust(32, b".") for i in range(n // 4)]
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=list(range(n)), new_request=True, append_block_hashes=hashes
    )
    r = c.step(
        "p", [pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=n))], s.session_id, s.fence
    )
    s.fence.CopyFrom(r.fence)
    assert r.results[0].status_code == 0, r


def test_a_stop_while_a_proven_restore_waits_for_a_sliced_step(
    make_server: Callable[..., InProcessServer], tmp_path: Path
) -> None:
    """A restore proven while another pool is mid-Step defers its fencing until no pool
    is held (journal_behind._fence_when_idle); a clean stop meanwhile waits the same way for
    its final snapshot. Both return once the Step is done (and the proving call is told
    INSTANCE_CHANGED)."""
    data, copy = tmp_path / "data", tmp_path / "copy"
    toml = pool_toml("p", 32) + pool_toml("q", 16, caching=False)
    server = make_server(toml, data_dir=str(data))
    with KVCoordClient(server.address, retry=NO_RETRY) as c:
        a = c.attach("p", "sha256_cbor", 4, "0", "worker-a", lease_seconds=60)
        subprocess.run(["cp", "-a", str(data), str(copy)], check=True)  # the backup
        _alloc(c, a, "a2", 16)  # history the backup lacks
    server.stop(snapshot=False)
    shutil.rmtree(data)
    subprocess.run(["cp", "-a", str(copy), str(data)], check=True)  # restored
    restored = make_server(toml, data_dir=str(data))
    registry = restored.running.servicer.registry
    locks = registry.locks
    restored.call(lambda: locks.take("q"))  # a Step applied to q in slices
    # told once the fencing is durable, so once q is given back
    (prover,), told = calls_in_threads(restored.address, lambda c: c.heartbeat(a.session_id, a.fence))
    deadline = time.monotonic() + 10
    while restored.call(lambda: registry.fencing is None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert restored.call(lambda: registry.fencing is not None), "the restore was not proven"
    stopped = threading.Event()

    def stop() -> None:
        try:
            restored._run(restored.running.stop(0.5, True), timeout=8)
        except Exception:  # noqa: BLE001
            return
        stopped.set()

    stopper = threading.Thread(target=stop)
    stopper.start()
    time.sleep(1.0)  # the stop waits for q too
    restored.loop.call_soon_threadsafe(locks.give, "q")  # the Step is done
    stopper.join(10)
    prover.join(10)
    assert stopped.is_set(), "the stop never returned: it and the deferred fencing hand pool q to each other"
    # (the stop ends the calls still waiting after its 0.5 s: told UNAVAILABLE, the
    # worker keeps its fence and proves the restore again at the next start)
    assert told and isinstance(told[0], (FencedError, UnavailableError)), told
