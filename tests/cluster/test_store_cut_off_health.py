"""A replica cut off from its cluster store (etcd SIGSTOPped: its sockets stay open,
nothing comes back) refuses every pool call once its membership lease may have ended;
its health says so: the Allocator service (``kvcoord.v1.Allocator``, what a readiness
probe or a load balancer asks) turns NOT_SERVING, and SERVING again once the replica
reaches the store again. The overall status ("") stays SERVING: the process answers
and a restart would not bring etcd back (a liveness probe asks that). Before, the
replica stayed SERVING on both while it refused every pool, so load balancers kept
routing workers to it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.client.testing import start_server
from service.helpers import allocate
from test_replicas import POOL_CONFIG

ALLOCATOR = "kvcoord.v1.Allocator"


def _wait_for(c: KVCoordClient, service: str, status: str, polls: int = 150) -> list[str]:
    """Ask the health of ``service`` until it is ``status`` (at most ``polls`` times, a
    fifth of a second apart); returns every answer seen."""
    seen = []
    for _ in range(polls):
        seen.append(c.health(service))
        if seen[-1] == status:
            break
        time.sleep(0.2)
    return seen


@pytest.mark.parametrize("journal", ["store", "local"])
def test_a_replica_cut_off_from_etcd_is_not_serving_until_it_reaches_it_again(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, journal: str
) -> None:
    cluster = request.node.name[-40:]
    text = (
        f'[server]\ndata_dir = "{tmp_path / "r0"}"\nsynchronous = "NORMAL"\n'
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{cluster}"\nreplica_id = "r0"\n'
        f'lease_seconds = 2\nstore_timeout_seconds = 1\njournal = "{journal}"\n'
    )
    server = start_server(text, env=env())
    try:
        with KVCoordClient(server.address, timeout=10.0, retry=NO_RETRY) as c:
            c.create_pool("w", POOL_CONFIG)
            s = c.attach("w", "sha256_cbor", 4, "0")
            c.allocate("w", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
            assert c.health(ALLOCATOR) == "SERVING"
            etcd.freeze()
            try:
                seen = _wait_for(c, ALLOCATOR, "NOT_SERVING")
                assert seen[-1] == "NOT_SERVING", (seen, server.log())
                assert c.health("") == "SERVING"  # the process answers: no restart wanted
                with pytest.raises(KVCoordError) as refused:  # what NOT_SERVING warns of
                    c.allocate("w", allocate("b", list(range(100, 108)), 8).allocate, s.session_id, s.fence)
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE, refused.value
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
            seen = _wait_for(c, ALLOCATOR, "SERVING")
            assert seen[-1] == "SERVING", (seen, server.log())
            assert c.health("") == "SERVING"
    finally:
        server.stop()
    log = server.log()
    assert "is cut off from the cluster store" in log, log
    assert "reaches the cluster store again" in log, log
