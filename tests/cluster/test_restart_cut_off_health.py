"""A replica SIGKILLed while cut off from its cluster store (etcd SIGSTOPped, or gone)
and restarted while the store is still away must never tell a readiness probe its
Allocator service is SERVING: it cannot hold its pools. The probe asks on the replica's
fixed port from the moment the new process listens (before it has joined the cluster,
or failed to) until it exits or the polls run out. The overall status ("") may say
SERVING (the process answers: test_store_cut_off_health.py). Nor may a replica whose
lease ended while it started (etcd gone right after it joined) say SERVING before its
first lease check: before, the start set SERVING whatever the lease said."""

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
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.client.testing import start_server
from ports import free_port
from service.helpers import allocate
from test_replicas import POOL_CONFIG

ALLOCATOR = "kvcoord.v1.Allocator"


def _config(tmp: Path, etcd: Etcd, cluster: str, port: int) -> str:
    return (
        f'[server]\ndata_dir = "{tmp / "r0"}"\nsynchronous = "NORMAL"\nlisten = ["127.0.0.1:{port}"]\n'
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{cluster}"\nreplica_id = "r0"\n'
        f'lease_seconds = 2\nstore_timeout_seconds = 1\njournal = "store"\n'
    )


def _runs(seen: list[str]) -> str:
    """``seen`` as runs of equal answers: "error NOT_FOUND x40, SERVING x12"."""
    runs: list[list[object]] = []
    for s in seen:
        if runs and runs[-1][0] == s:
            runs[-1][1] = int(str(runs[-1][1])) + 1
        else:
            runs.append([s, 1])
    return ", ".join(f"{s} x{n}" for s, n in runs)


def _probe(address: str, proc: subprocess.Popen[str], polls: int = 200) -> list[tuple[str, str]]:
    """The Allocator's and the overall health as the restarted replica answers them, a
    twentieth of a second apart, until it exits (and a last few polls after that)."""
    seen: list[tuple[str, str]] = []
    with KVCoordClient(address, timeout=0.5, retry=NO_RETRY) as c:
        for _ in range(polls):
            exited = proc.poll() is not None
            answers = []
            for service in (ALLOCATOR, ""):
                try:
                    answers.append(c.health(service))
                except KVCoordError as exc:
                    answers.append(f"error {exc.code.name}")
            seen.append((answers[0], answers[1]))
            if exited:
                break
            time.sleep(0.05)
    return seen


@pytest.mark.parametrize("away", ["stopped", "killed"])
def test_a_replica_restarted_while_cut_off_from_etcd_never_says_serving(
    tmp_path: Path, request: pytest.FixtureRequest, away: str
) -> None:
    etcd = Etcd(tmp_path / "etcd")  # its own: this test stops it
    port = free_port()
    text = _config(tmp_path, etcd, request.node.name[-40:], port)
    server = start_server(text, env=env())
    restarted: subprocess.Popen[str] | None = None
    try:
        with KVCoordClient(server.address, timeout=10.0, retry=NO_RETRY) as c:
            c.create_pool("w", POOL_CONFIG)
            s = c.attach("w", "sha256_cbor", 4, "0")
            c.allocate("w", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
            assert c.health(ALLOCATOR) == "SERVING"
        if away == "stopped":
            etcd.freeze()
        else:
            etcd.proc.kill()
            etcd.proc.wait()
        server.proc.kill()  # SIGKILL while cut off
        server.proc.wait()
        config = tmp_path / "restart.toml"
        config.write_text(text)
        with (tmp_path / "restart.log").open("w", encoding="utf-8") as log:
            restarted = subprocess.Popen(
                [sys.executable, "-m", "kvcoord.service.cli", "serve", "--metrics-listen", "", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, text=True, env=env(),
            )  # fmt: skip
            seen = _probe(f"127.0.0.1:{port}", restarted)
        out = (tmp_path / "restart.log").read_text()
        assert [a for a, _ in seen if a == "SERVING"] == [], (seen, out)
        # the probe saw the restarted process (it answered at least once, or exited)
        assert restarted.poll() is not None or any(not a.startswith("error UNAVAILABLE") for a, _ in seen), (
            seen,
            out,
        )
    finally:
        if away == "stopped" and etcd.proc.poll() is None:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        if restarted is not None and restarted.poll() is None:
            restarted.kill()
            restarted.wait()
        server.stop()
        etcd.stop()


#: a hook (sitecustomize of the replica's process) that lets the test cut etcd away the
#: moment the replica has joined, holds the start until its lease has ended (etcd gone),
#: and makes the first lease check of the Allocator's health come late (a loaded event
#: loop: it is a task of its own, run after whatever else is ready)
_HOOK = """
import asyncio
import kvcoord.service.server as server

_join, _follow = server.join_cluster, server.follow_store_health


async def join_cluster(cfg, cluster, registry, servicer):
    await _join(cfg, cluster, registry, servicer)
    print("HOOK joined", flush=True)
    for _ in range(400):
        if not cluster.view.lease_valid:
            break
        await asyncio.sleep(0.05)
    print("HOOK lease ended" if not cluster.view.lease_valid else "HOOK lease still valid", flush=True)


async def follow_store_health(cluster, serving):
    await asyncio.sleep(4.0)
    await _follow(cluster, serving)


server.join_cluster, server.follow_store_health = join_cluster, follow_store_health
"""


def test_a_replica_whose_lease_ended_while_it_started_is_not_serving_before_its_first_lease_check(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """etcd is SIGSTOPped right after the replica joined; by the time the replica
    finishes starting its lease has ended (it holds no pool), and its first lease check
    comes late. Between start and that check its Allocator must not say SERVING (before,
    the start set SERVING whatever the lease said, until the first check turned it)."""
    etcd = Etcd(tmp_path / "etcd")
    port = free_port()
    config = tmp_path / "r0.toml"
    config.write_text(_config(tmp_path, etcd, request.node.name[-40:], port))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOOK)
    e = env()
    e["PYTHONPATH"] = f"{hook}:{e['PYTHONPATH']}"
    log_path = tmp_path / "r0.log"
    stopped = False
    proc: subprocess.Popen[str] | None = None
    try:
        with log_path.open("w", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvcoord.service.cli", "serve", "--metrics-listen", "", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, text=True, env=e,
            )  # fmt: skip
        for _ in range(600):  # (at most 30 s)
            if "HOOK joined" in log_path.read_text() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert "HOOK joined" in log_path.read_text(), log_path.read_text()
        etcd.freeze()
        stopped = True
        seen: list[str] = []
        with KVCoordClient(f"127.0.0.1:{port}", timeout=0.5, retry=NO_RETRY) as c:
            after = 0  # polls since the start went on (the hook's late first check: 4 s on)
            for _ in range(400):  # (at most about 40 s)
                try:
                    seen.append(c.health(ALLOCATOR))
                except KVCoordError as exc:
                    seen.append(f"error {exc.code.name}")
                after += "kvcoord serving gRPC on" in log_path.read_text()
                if after >= 20:
                    break
                time.sleep(0.05)
        out = log_path.read_text()
        assert "HOOK lease ended" in out, out
        assert "kvcoord serving gRPC on" in out, out
        assert "SERVING" not in seen, (_runs(seen), out)
        assert seen[-1] == "NOT_SERVING", (_runs(seen), out)
    finally:
        if stopped:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        etcd.stop()
