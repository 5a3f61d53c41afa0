"""The exporter follows Prometheus' naming rules: `promtool check metrics` on a live
scrape of a real server that has served every kind of call its series count."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from helpers import allocate, attach
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.testing import start_server
from prometheus_client.parser import text_string_to_metric_families
from support import POOL_TOML

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}")


def _load(address: str) -> None:
    """Hits, a refusal, a wrong hash handshake, a NOT_FOUND: every family gets samples."""
    with KVCoordClient(address, timeout=10, retry=NO_RETRY) as c:
        sid, fence = attach(c, "p")
        prompt = list(range(100, 140))
        c.allocate("p", allocate("a", prompt, len(prompt)).allocate, sid, fence)
        c.free("p", ["a"], session_id=sid, fence=fence)
        c.allocate("p", allocate("b", prompt, len(prompt)).allocate, sid, fence)
        big = list(range(1000, 1250))  # more blocks than the pool has left
        assert c.allocate("p", allocate("c", big, len(big)).allocate, sid, fence).result.refused
        with pytest.raises(KVCoordError):
            attach(c, "p", block_size=8)  # hashes differently: refused, counted
        with pytest.raises(KVCoordError):
            c.get_stats("no-such-pool")


def test_promtool_check_metrics_accepts_a_live_scrape() -> None:
    """A real server's /metrics after a load: `promtool check metrics` finds nothing to
    say (no problem, no lint), every counter, gauge and histogram has samples, and the
    journal's commit latency was observed."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: run `make install` (Debian's prometheus)"
    server = start_server(POOL_TOML, metrics=True, env=_env())
    try:
        _load(server.address)
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10) as r:
            body = r.read().decode()
    finally:
        assert server.stop() == 0
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert {"kvcoord_blocks_usable", "kvcoord_allocation_refusals", "kvcoord_hash_handshake_refusals",
            "grpc_server_handling_seconds"} <= set(families)  # fmt: skip
    assert all(f.samples for f in families.values())
    # the server is journaled (start_server gives it a data directory): the load's
    # mutations waited for journal commits, each timed
    commits = {s.name: s.value for s in families["kvcoord_journal_commit_seconds"].samples}
    assert commits["kvcoord_journal_commit_seconds_count"] > 0
    assert commits["kvcoord_journal_commit_seconds_sum"] > 0
    # the server process' own CPU and memory (the dashboard's server CPU panel, the
    # KVCoordCPUSaturated alert): the load cost it CPU time, and it holds memory
    assert families["process_cpu_seconds"].samples[0].value > 0
    assert families["process_resident_memory_bytes"].samples[0].value > 0
