"""`kvcoord serve --replicas N`: N supervised replica processes of one cluster on one
host (real processes, real etcd)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.service.config import parse_config
from kvcoord.service.ownership import Member, owner_of
from kvcoord.service.replicas import child_settings, replica_count
from ports import free_port_run
from test_replicas import POOL_CONFIG


def test_replica_count_and_each_childs_settings() -> None:
    assert replica_count("3") == 3 and replica_count("auto", cpus=4) == 4 and replica_count("0", cpus=2) == 2
    with pytest.raises(ValueError):
        replica_count("-1")
    cfg = parse_config(
        '[server]\nlisten = ["0.0.0.0:7000"]\nmetrics_listen = "0.0.0.0:9400"\ndata_dir = "/d"\n'
        '[cluster]\nendpoints = ["e:2379"]\nreplica_id = "node"\nadvertise_address = "node.example:7000"\n'
    )
    assert child_settings(cfg, 2) == {
        "KVCOORD_LISTEN": "0.0.0.0:7002",
        "KVCOORD_METRICS_LISTEN": "0.0.0.0:9402",
        "KVCOORD_REPLICA_ID": "node-2",
        "KVCOORD_DATA_DIR": "/d/replica-2",
        "KVCOORD_ADVERTISE_ADDRESS": "node.example:7002",
    }


def _serving(address: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    with KVCoordClient(address, timeout=1.0) as c:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the supervisor exited"
            try:
                if c.health() == "SERVING":
                    return
            except KVCoordError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not serve within {timeout} s")


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def test_serve_replicas_runs_supervised_replicas_that_share_the_pools(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    port = free_port_run(2)  # (restarted children bind theirs again: none from the ephemeral range)
    config = tmp_path / "kvcoord.toml"
    config.write_text(
        f'[server]\nlisten = ["127.0.0.1:{port}"]\nmetrics_listen = ""\ndata_dir = "{tmp_path / "data"}"\n'
        f'synchronous = "NORMAL"\ngrace_seconds = 5.0\n'
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{request.node.name}"\nreplica_id = "h"\n'
        "lease_seconds = 2\n"
    )
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(config), "--replicas", "2"],
        stdout=log, stderr=subprocess.STDOUT, env=env(),
    )  # fmt: skip
    addresses = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    try:
        for a in addresses:
            _serving(a, 60, proc)
        members = [Member("h-0", ""), Member("h-1", "")]
        pools = [f"s{i}" for i in range(6)]
        with KVCoordClient(addresses) as c:
            for p in pools:
                c.create_pool(p, POOL_CONFIG)
            listed = {i.name: i.replica for i in c.list_pools().pools}
        assert listed == {p: owner_of(p, members).replica_id for p in pools}  # type: ignore[union-attr]
        assert set(listed.values()) == {"h-0", "h-1"}
        assert (tmp_path / "data" / "replica-0").is_dir() and (tmp_path / "data" / "replica-1").is_dir()
        # a replica dies: the supervisor starts it again, and it claims its pools again
        first = _children(proc.pid)
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = _children(proc.pid)
            if len(now) == 2 and first[0] not in now:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the supervisor did not restart the replica")
        deadline = time.monotonic() + 60
        again: dict[str, str] = {}
        while time.monotonic() < deadline and again != listed:
            try:
                with KVCoordClient(addresses, timeout=2.0) as c:
                    again = {i.name: i.replica for i in c.list_pools().pools}
            except KVCoordError:
                pass
            time.sleep(0.2)
        assert again == listed
        last = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not [pid for pid in last if Path(f"/proc/{pid}").exists()]  # every replica stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
