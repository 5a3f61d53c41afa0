"""A replica killed in the middle of handing a pool over, started again while the new
owner is away (``[cluster] journal = "local"``).

The old owner a sends the pool (AdoptPool); the adopter b journals it and swaps the
claim; a is killed before it removes its own copy (journaled). b serves the pool and
acknowledges allocations, then stops (or dies): nobody claims the pool. a starts again
from its journal, which still holds the pool as it was when it was sent. a claimed it
(it held state of a pool nobody claimed) and served that copy: what b acknowledged was
gone, and a gave its blocks out again. The claim in the store now leaves a mark that
outlives it (who claimed the pool last); a replica claims its own copy again only when
it was that replica, else the pool waits for the replica that holds it last (b), whose
claim then sends a's copy away.

Real etcd, two real ``kvcoord serve`` replicas. A server hook
(durable_server.with_sitecustomize) kills a (SIGKILL) when the handover's answer
arrives, before a removes its copy."""

from __future__ import annotations

from pathlib import Path

import durable_server
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.errors import OwnerChangingError
from kvcoord.client.testing import ServerProcess, start_server
from service.helpers import allocate
from test_handover_late_swap import _config, _created_with_one_request, _served, _until
from test_replicas import placed

HOOK = """
import os
import signal

if os.environ.get("KVCOORD_TEST_KILL_WHEN_HANDED_OVER"):  # killed before the copy here is removed
    import kvcoord.service.registry as registry

    def _handed_over(self, name):
        os.kill(os.getpid(), signal.SIGKILL)

    registry.PoolRegistry.handed_over = _handed_over
"""


def _told(address: str, pool: str) -> KVCoordError | None:
    """What ``address`` answers GetPool of ``pool`` (one try; None: served)."""
    try:
        with KVCoordClient(address, timeout=5.0, retry=NO_RETRY) as c:
            c.get_pool(pool)
    except KVCoordError as err:
        return err
    return None


def test_a_copy_handed_over_before_a_kill_is_not_claimed_while_its_new_owner_is_away(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = request.node.name
    pool = placed("handed", "b", ["a", "b"])  # placement moves it to b once b joins
    durable_server.with_sitecustomize(tmp_path, HOOK, monkeypatch)
    a_config = _config(etcd.endpoint, "a", tmp_path / "a", cluster, "local")
    b_config = _config(etcd.endpoint, "b", tmp_path / "b", cluster, "local")
    a: ServerProcess | None = start_server(
        a_config, env={**durable_server.env(), "KVCOORD_TEST_KILL_WHEN_HANDED_OVER": "1"}
    )
    b: ServerProcess | None = None
    killed = a
    try:
        assert a is not None
        s, acknowledged = _created_with_one_request(a.address, pool)
        b = start_server(b_config, env=durable_server.env())
        _until(lambda: a.proc.poll(), 30, "a handed the pool over and was killed")  # type: ignore[union-attr]
        a = None
        assert _until(lambda: _served([b.address], pool), 30, "b serves the pool") == acknowledged  # type: ignore[union-attr]
        with KVCoordClient(b.address, timeout=5.0) as c:
            r2 = c.allocate(pool, allocate("r2", list(range(100, 108)), 8).allocate, s.session_id, s.fence)
        acknowledged["r2"] = list(r2.result.new_block_ids[0].block_ids)
        b.stop()  # a is gone: nobody to hand the pool to; its claim ends with b
        b = None

        a = start_server(a_config, env=durable_server.env())  # its journal holds the pool as sent
        told = _told(a.address, pool)
        assert isinstance(told, OwnerChangingError), (told, _served([a.address], pool))  # not its stale copy

        b = start_server(b_config, env=durable_server.env())
        assert _until(lambda: _served([a.address, b.address], pool), 40, "the pool is served") == acknowledged
        with KVCoordClient([a.address, b.address], timeout=5.0) as c:
            r3 = c.allocate(pool, allocate("r3", list(range(200, 208)), 8).allocate, s.session_id, s.fence)
        assert not set(r3.result.new_block_ids[0].block_ids) & {
            i for ids in acknowledged.values() for i in ids
        }
    finally:
        for p in (killed, a, b):
            if p is not None:
                p.stop()
