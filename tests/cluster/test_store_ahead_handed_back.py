"""``journal = "store"``: a record the cluster store committed but its replica's own
journal did not when the replica died, answered by ANOTHER replica that took the pool
over, then handed back to the restarted replica, is no restored data directory.

r0 owns the pool; each record goes to its local journal and to the pool's stream in the
store at once, and the answer waits for both. r0 is SIGKILLed in between (a server hook
holds its local commits): the store holds record N of r0's dead instance, r0's own
journal ends at N-1. r1 takes the pool over from the store and answers the client's
retry (same idempotency key) from that record's kept answer: a fence naming position N
of r0's dead instance, tagged with r0's journal key. r0 starts again, and r1 hands the
pool back to it (placement puts the pool on r0) before the client calls again. The
handed-over state must carry what the pool holds of r0's dead instance: before the
fix, the client's next call at r0 "proved" r0's journal behind what clients were told
(every session of every pool of r0 ended, every prefix cache reset, Attach refused for
the grace period) after a plain crash with nothing lost. Found by a failover review
(finding F2, the handover left out of the first fix)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import durable_server
import pytest
from durable_workload import PATIENT
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import ServerProcess, start_server
from ports import free_port
from service.helpers import allocate
from test_failover import _config
from test_replicas import POOL_CONFIG, placed_many, wait_members

#: a replica started with KVCOORD_TEST_HOLD set: its local journal's commits wait while
#: that file exists (its store writes go on, and each one made meanwhile touches
#: KVCOORD_TEST_STORED)
_HOLD_LOCAL_COMMITS = """
import os
import pathlib
import time

hold, stored = os.environ.get("KVCOORD_TEST_HOLD"), os.environ.get("KVCOORD_TEST_STORED")
if hold and stored:
    import kvcoord.service.journal as journal
    import kvcoord.service.store_journal as store_journal

    _write = journal.JournalStore.write
    _write_pool = store_journal.PoolStreams._write_pool

    def write(self, records, chunk=None):
        while os.path.exists(hold):
            time.sleep(0.01)
        return _write(self, records, chunk)

    async def write_pool(self, pool, items):
        await _write_pool(self, pool, items)
        if os.path.exists(hold):
            pathlib.Path(stored).touch()

    journal.JournalStore.write = write
    store_journal.PoolStreams._write_pool = write_pool
"""

BEHIND = "journal is behind what clients were told"


def _until(done: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if done():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds} s: {what}")


def _replica_of(addresses: list[str], pool: str) -> str | None:
    """The replica serving ``pool`` as the replica set lists it (None: not listed)."""
    try:
        with KVCoordClient(addresses, timeout=2.0) as c:
            return next((p.replica for p in c.list_pools().pools if p.name == pool), None)
    except Exception:  # noqa: BLE001 - a replica starting or stopping: asked again
        return None


def test_a_store_record_answered_elsewhere_and_handed_back_is_no_restore(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry is answered by r1 from the store's record; after the handover back to
    the restarted r0, the client's next fenced call at r0 goes on, and a session of
    r0's other pool lives on."""
    cluster = request.node.name[:40]
    ids = ["r0", "r1"]
    pool, other = placed_many("back", "r0", ids, 2)
    flag, stored = tmp_path / "hold", tmp_path / "stored"
    durable_server.with_sitecustomize(tmp_path, _HOLD_LOCAL_COMMITS, monkeypatch)
    r0_address = f"127.0.0.1:{free_port()}"
    held_env = {**durable_server.env(), "KVCOORD_TEST_HOLD": str(flag), "KVCOORD_TEST_STORED": str(stored)}
    procs: dict[str, list[ServerProcess]] = {"r0": [], "r1": []}

    def start(replica: str) -> ServerProcess:
        config = _config([etcd.endpoint], replica, tmp_path / replica, cluster, "store", 1000)
        if replica == "r0":  # one address across restarts
            proc = start_server(config, env=held_env, extra_args=("--listen", r0_address))
        else:
            proc = start_server(config, env=durable_server.env())
        procs[replica].append(proc)
        return proc

    def log(replica: str) -> str:
        return "".join(Path(p.log_path).read_text() for p in procs[replica])

    try:
        start("r0")
        r1 = start("r1")
        wait_members([procs["r0"][-1], r1], ids)
        addresses = [r0_address, r1.address]
        with KVCoordClient(r0_address, timeout=10, retry=PATIENT) as c:
            assert c.create_pool(pool, POOL_CONFIG).pool.replica == "r0"
            assert c.create_pool(other, POOL_CONFIG).pool.replica == "r0"
            s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=120)
            bystander = c.attach(other, "sha256_cbor", 4, "0", lease_seconds=120)
            first = c.allocate(pool, allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
        flag.touch()
        answers = {}

        def second() -> None:  # retried (same idempotency key) until a replica answers it
            with KVCoordClient(addresses, timeout=60, retry=PATIENT) as c2:
                answers["b"] = c2.allocate(pool, allocate("b", list(range(100, 108)), 8).allocate,
                                           s.session_id, first.fence)  # fmt: skip

        t = threading.Thread(target=second, daemon=True)
        t.start()
        _until(stored.exists, 30, "the store committed the record (r0's own journal waits)")
        assert "b" not in answers
        procs["r0"][-1].proc.kill()  # SIGKILL between the store's commit and the local one
        procs["r0"][-1].stop()
        flag.unlink()
        t.join(90)
        assert "b" in answers, "the retried call was answered"
        got = answers["b"]
        assert got.fence.instance_id == first.fence.instance_id  # r0's dead instance's record
        assert f"took pool {pool} over from the cluster store" in r1.log()  # answered by r1

        start("r0")  # r1 hands both pools back (placement puts them on r0)
        _until(lambda: _replica_of(addresses, pool) == "r0", 60, "the pool handed back to r0")
        _until(lambda: _replica_of(addresses, other) == "r0", 60, "the other pool handed back to r0")
        assert f"handed pool {pool} over to replica r0" in r1.log()
        with KVCoordClient([r1.address], timeout=10, retry=PATIENT) as c:  # redirected to r0
            held = {
                q.request_id: list(q.groups[0].block_ids)
                for q in c.inspect_pool(pool, all_requests=True).requests
            }
            assert held == {"a": list(first.result.new_block_ids[0].block_ids),
                            "b": list(got.result.new_block_ids[0].block_ids)}  # fmt: skip
            third = c.allocate(
                pool, allocate("c", list(range(200, 208)), 8).allocate, s.session_id, got.fence
            )
            assert third.fence.instance_id != first.fence.instance_id  # r0's new instance answered
            c.heartbeat(bystander.session_id, bystander.fence, pool=other)
        assert BEHIND not in log("r0")
    finally:
        flag.unlink(missing_ok=True)
        for p in procs["r0"] + procs["r1"]:
            p.stop()
