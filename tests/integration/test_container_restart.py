"""The CI container killed (`docker kill`) and started again (`docker start`) in the
middle of a multi-worker workload: its journal is on a volume, so it comes back with
every acknowledged allocation and the workers carry on as if nothing happened.

Collected against the container scripts/test.sh starts (KVCOORD_CONTAINER names it; its
host ports are fixed, so the address survives `docker start`); skipped against an
external deployment."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import uuid
from typing import Any

import pytest
from conftest import TLS, connect, wait_for
from durable_workload import PATIENT, run_checked_worker
from kvcoord.client import NO_RETRY
from kvcoord.client.errors import KVCoordError
from workload import check_pool, pool_config

CONTAINER = os.environ.get("KVCOORD_CONTAINER", "")
NUM_WORKERS = 4
NUM_BLOCKS = 300
#: steps every worker checks before the kill, and again after the restart
STEPS_BEFORE = 10
STEPS_AFTER = 20

pytestmark = pytest.mark.skipif(not CONTAINER, reason="KVCOORD_CONTAINER is not set (external deployment)")


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def _state(field: str) -> str:
    return docker("inspect", "-f", "{{" + field + "}}", CONTAINER).stdout.strip()


def _serving(target: str) -> bool:
    """The gRPC health check, over the suite's TLS (one attempt, short deadline)."""
    try:
        with connect(target, timeout=2, retry=NO_RETRY) as c:
            return bool(c.health() == "SERVING")
    except KVCoordError:
        return False


def _all_past(progress: list[Any], marks: list[int]) -> bool:
    return all(p.value >= m for p, m in zip(progress, marks, strict=True))


@pytest.mark.timeout(900)
def test_docker_kill_and_start_mid_workload_loses_nothing(target: str) -> None:
    """Four worker processes drive one pool over mutual TLS; mid-workload the container
    is `docker kill`ed and `docker start`ed. Every worker's own record of its block
    tables matches the server after every step (before, across and after the restart),
    no block is held by two live requests, no worker is told its requests were lost,
    the server instance changed but the pool did not, and the pool ends fully free."""
    mounts = json.loads(docker("inspect", "-f", "{{json .Mounts}}", CONTAINER).stdout or "[]")
    data = [m for m in mounts if m.get("Destination") == "/var/lib/kvcoord"]
    assert data, f"the container's data directory is on no volume: {mounts}"

    pool = f"restart-{uuid.uuid4().hex[:6]}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    progress = [ctx.Value("q", 0) for _ in range(NUM_WORKERS)]
    procs: list[Any] = []
    reports: list[dict[str, Any]] = []
    with connect(target, timeout=20, retry=PATIENT) as c:
        created = c.create_pool(pool, pool_config(NUM_BLOCKS)).pool
        try:
            procs = [
                ctx.Process(
                    target=run_checked_worker,
                    args=(target, pool, w, 700 + w, stop, out, TLS, progress[w]),
                )
                for w in range(NUM_WORKERS)
            ]
            for p in procs:
                p.start()
            # mid-workload: every worker has checked some steps and requests are live
            assert wait_for(lambda: _all_past(progress, [STEPS_BEFORE] * NUM_WORKERS), timeout=120), [
                p.value for p in progress
            ]
            assert wait_for(lambda: check_pool(c, pool, NUM_BLOCKS) > 0, timeout=60, interval=0.02)

            kill = docker("kill", CONTAINER)
            assert kill.returncode == 0, kill.stderr
            assert wait_for(lambda: _state(".State.Running") == "false", timeout=60), _state(".State.Status")
            marks = [p.value + STEPS_AFTER for p in progress]
            start = docker("start", CONTAINER)
            assert start.returncode == 0, start.stderr
            # health through TLS: the suite's own check, then Docker's (its --health-cmd
            # speaks mutual TLS too)
            assert wait_for(lambda: _serving(target), timeout=120), docker(
                "logs", "--tail", "30", CONTAINER
            ).stderr
            assert wait_for(lambda: _state(".State.Health.Status") == "healthy", timeout=120), _state(
                ".State.Health.Status"
            )

            after = c.get_pool(pool).pool
            assert after.fence.instance_id != created.fence.instance_id, "the server did not restart"
            assert after.fence.incarnation == created.fence.incarnation, "the pool was re-created"
            check_pool(c, pool, NUM_BLOCKS)

            # the workers carry on (each checks its tables against the server every step)
            wait_for(lambda: _all_past(progress, marks) or not all(p.is_alive() for p in procs), timeout=180)
            steps = [p.value for p in progress]
            check_pool(c, pool, NUM_BLOCKS)

            stop.set()
            reports = [out.get(timeout=120) for _ in procs]
            for p in procs:
                p.join(30)
            check_pool(c, pool, NUM_BLOCKS)
            stats = c.get_stats(pool)
        finally:
            stop.set()
            for p in procs:
                if p.is_alive():
                    p.kill()
            try:
                c.delete_pool(pool)
            except KVCoordError:
                pass  # reported by the assertions above, if at all
    assert len(reports) == NUM_WORKERS
    for r in reports:
        assert r["error"] == "", r
        assert r["lost"] == 0, r
        assert r["checks"] > 0 and r["allocs"] > 0, r
    assert all(s >= m for s, m in zip(steps, marks, strict=True)), (
        f"workers did not carry on: {steps} < {marks}"
    )
    assert stats.num_requests == 0 and stats.num_free_blocks == NUM_BLOCKS - 1, stats
