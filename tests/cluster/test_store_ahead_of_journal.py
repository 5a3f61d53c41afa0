"""``journal = "store"``: a record the cluster store committed but the replica's own
journal did not when the replica died (its call was never answered) is no restored
data directory.

Each record goes to the local journal and to the pool's stream in the store at once;
the answer waits for both. Killed in between, the replica restarts, rebuilds the pool
from the store (the record included) and answers the client's retry from that record's
kept answer, whose fence names the record's position in the dead instance's journal,
one past what its own journal holds. Before the fix, the client's next fenced call
"proved" the journal behind what clients were told: every session of every pool of the
replica ended, every prefix cache reset and Attach refused for the grace period, after
a plain crash with nothing lost. Found by a failover review (finding F2).
"""

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
from test_replicas import POOL_CONFIG

#: the local journal's commits wait while the flag file exists (the store's go on, and
#: each one committed meanwhile touches the "stored" file)
_HOLD_LOCAL_COMMITS = """
import os
import pathlib
import time

import kvcoord.service.journal as journal
import kvcoord.service.store_journal as store_journal

_write = journal.JournalStore.write
_write_pool = store_journal.PoolStreams._write_pool


def write(self, records, chunk=None):
    while os.path.exists({flag!r}):
        time.sleep(0.01)
    return _write(self, records, chunk)


async def write_pool(self, pool, items):
    await _write_pool(self, pool, items)
    if os.path.exists({flag!r}):
        pathlib.Path({stored!r}).touch()


journal.JournalStore.write = write
store_journal.PoolStreams._write_pool = write_pool
"""

BEHIND = "journal is behind what clients were told"


def test_a_record_in_the_store_not_yet_on_disk_is_no_restore(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retried call is answered from the store's record; the next fenced calls
    (this instance's, and the next one's after another SIGKILL: the raised end is
    journaled) go on, and a session of another pool of the replica lives on."""
    cluster = request.node.name[:40]
    flag, stored = tmp_path / "hold", tmp_path / "stored"
    hook = _HOLD_LOCAL_COMMITS.format(flag=str(flag), stored=str(stored))
    durable_server.with_sitecustomize(tmp_path, hook, monkeypatch)
    address = f"127.0.0.1:{free_port()}"
    config = _config([etcd.endpoint], "r0", tmp_path / "r0", cluster, "store", 1000)
    procs: list[ServerProcess] = []

    def start() -> None:
        procs.append(start_server(config, env=durable_server.env(), extra_args=("--listen", address)))

    def kill() -> None:
        procs[-1].proc.kill()
        procs[-1].stop()

    def log() -> str:
        return "".join(Path(p.log_path).read_text() for p in procs)

    try:
        start()
        with KVCoordClient(address, timeout=10, retry=PATIENT) as c:
            c.create_pool("p", POOL_CONFIG)
            c.create_pool("other", POOL_CONFIG)
            s = c.attach("p", "sha256_cbor", 4, "0", lease_seconds=60)
            bystander = c.attach("other", "sha256_cbor", 4, "0", lease_seconds=60)
            first = c.allocate("p", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
        flag.touch()
        answers = {}

        def second() -> None:  # retried (same idempotency key) until the restarted replica answers
            with KVCoordClient(address, timeout=60, retry=PATIENT) as c2:
                answers["b"] = c2.allocate("p", allocate("b", list(range(100, 108)), 8).allocate,
                                           s.session_id, first.fence)  # fmt: skip

        t = threading.Thread(target=second, daemon=True)
        t.start()
        deadline = time.monotonic() + 30  # the store commits the record; the local journal waits
        while not stored.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stored.exists(), "the store did not commit the record"
        assert "b" not in answers
        kill()
        flag.unlink()
        start()
        t.join(60)
        assert "b" in answers, "the retried call was answered"
        got = answers["b"]
        assert got.fence.instance_id == first.fence.instance_id  # the dead instance's record
        with KVCoordClient(address, timeout=10, retry=PATIENT) as c:
            held = {
                q.request_id: list(q.groups[0].block_ids)
                for q in c.inspect_pool("p", all_requests=True).requests
            }
            assert held == {"a": list(first.result.new_block_ids[0].block_ids),
                            "b": list(got.result.new_block_ids[0].block_ids)}  # fmt: skip
            third = c.allocate("p", allocate("c", list(range(200, 208)), 8).allocate, s.session_id, got.fence)
            c.heartbeat(bystander.session_id, bystander.fence)
        assert BEHIND not in log()
        kill()  # the next instance keeps the raised end (journaled with the pool's adoption)
        start()
        with KVCoordClient(address, timeout=10, retry=PATIENT) as c:
            c.allocate("p", allocate("d", list(range(300, 308)), 8).allocate, s.session_id, got.fence)
            c.allocate("p", allocate("e", list(range(400, 408)), 8).allocate, s.session_id, third.fence)
            c.heartbeat(bystander.session_id, bystander.fence)
            assert {q.request_id for q in c.inspect_pool("p", all_requests=True).requests} == set("abcde")
        assert BEHIND not in log()
    finally:
        if flag.exists():
            flag.unlink()
        for p in procs:
            p.stop()
