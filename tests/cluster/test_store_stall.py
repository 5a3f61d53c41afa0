"""A replica whose cluster store stops answering (etcd SIGSTOPped: its sockets stay
open, nothing comes back) while a call waits on its pool's journal write there
(``journal = "store"``): the write is given up after ``journal_stall_seconds`` (here
4 s, half the 8 s session lease), the call is answered UNAVAILABLE (outcome
unknown: its keyed retry is safe) and the pool is given up here, before the waiting
worker's session lease ends. (Before, the write was retried for as long as the
membership lease was sure to be alive and then the call in flight ran to its
deadline: 13.9 s with the defaults, lease_seconds 10 and store_timeout_seconds 5, and
the worker's session expired on the replica while its call waited.)"""

from __future__ import annotations

import os
import re
import signal
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

LEASE = 8.0


def test_a_store_that_stops_answering_fails_the_call_before_the_session_lease_ends(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = request.node.name[:40]
    text = (
        f'[server]\ndata_dir = "{tmp_path / "r0"}"\nsynchronous = "NORMAL"\n'
        f"session_lease_seconds = {LEASE}\nmax_session_lease_seconds = {LEASE}\n"
        f"idempotency_window_seconds = {4 * LEASE}\njournal_stall_seconds = {LEASE / 2}\n"
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{cluster}"\nreplica_id = "r0"\n'
        'journal = "store"\n'  # lease_seconds 10, store_timeout_seconds 5: the defaults
    )
    server = start_server(text, env=env())
    try:
        with KVCoordClient(server.address, timeout=60.0, retry=NO_RETRY) as c:
            c.create_pool("w", POOL_CONFIG)
            s = c.attach("w", "sha256_cbor", 4, "0", lease_seconds=LEASE)
            c.allocate("w", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
            etcd.freeze()  # (was a bare SIGSTOP: etcd's threads, not yet stopped, committed "b")
            try:
                with pytest.raises(KVCoordError) as failed:
                    c.allocate("w", allocate("b", list(range(100, 108)), 8).allocate, s.session_id, s.fence)
                assert failed.value.code == grpc.StatusCode.UNAVAILABLE, failed.value
                log = server.log()
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
    finally:
        server.stop()
    given_up = re.search(r"journal of pool w could not be written to the store: .*journal_stall_seconds", log)
    assert given_up is not None, log
    expired = re.search(r"session \w+ .* of pool w expired", log)
    assert expired is None or expired.start() > given_up.start(), log  # the call was answered first
