"""The server as a separate process: `kvcoord serve`, conformance over the wire, and
four worker processes driving one pool at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import start_server
from workload import pool_config, run_many_workers

ROOT = Path(__file__).resolve().parents[2]
TRACES = sorted((ROOT / "tests" / "conformance" / "data").glob("*.jsonl"))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT / 'client'}:{ROOT / 'server'}"
    env.update(extra)
    return env


def test_serve_with_no_arguments_then_sigterm(tmp_path: Path) -> None:
    """`kvcoord serve` runs the embedded default, says where it listens and keeps its
    data, and stops cleanly."""
    data = tmp_path / "data"  # the embedded default's ./kvcoord-data, moved out of the tree
    env = _env(KVCOORD_LISTEN="127.0.0.1:0", KVCOORD_METRICS_LISTEN="127.0.0.1:0", KVCOORD_DATA_DIR=str(data))
    server = start_server(None, metrics=True, env=env, extra_args=())
    try:
        with KVCoordClient(server.address) as c:
            pools = c.list_pools().pools
            assert [(p.name, p.coordinator, p.config.num_blocks) for p in pools] == [
                ("default", "hybrid", 16384)
            ]
            assert c.health() == "SERVING"
            streamed: list[str] = []
            got_event = threading.Event()

            def watch() -> None:  # an open stream must end cleanly on shutdown
                for _ in c.watch_events("default", 0, timeout=30):
                    got_event.set()
                streamed.append("ended")

            t = threading.Thread(target=watch)
            t.start()
            tokens = list(range(40))
            sid, fence = attach(c, "default", block_size=16)
            c.allocate("default", allocate("r", tokens, 40, block_size=16).allocate, sid, fence)
            assert got_event.wait(20), "the stream delivered no event"
            assert server.stop() == 0
            t.join(30)
            assert streamed == ["ended"]
        log = server.log()
        assert f"kvcoord serving gRPC on {server.address}; pools: default" in log
        assert "kvcoord metrics on http://127.0.0.1:" in log
        assert f"kvcoord data directory {data}" in log and (data / "journal.sqlite").exists()
        assert log.rstrip().endswith("kvcoord stopped")
    finally:
        server.stop()


def test_serve_rejects_a_bad_config_file(tmp_path: Path) -> None:
    """A bad config file is reported with the key and exit status 2."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[pools]]\nname = "x"\nnum_blocks = 10\nhash_block_size = 4\nbogus = 1\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(cfg)],
        capture_output=True, text=True, env=_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "pools[0] (x): unknown key 'bogus'" in proc.stderr


#: the journal written as by default, without an fsync per commit (as tests/cluster's
#: replicas): a mutating call waited ~3.5 ms for the disk, most of this test's time
NO_FSYNC = '[server]\nsynchronous = "NORMAL"\n'


def test_conformance_over_the_wire() -> None:
    """`kvcoord conformance --target` replays every public trace through the client."""
    server = start_server(NO_FSYNC, env=_env())
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcoord.conformance", "--target", server.address, *map(str, TRACES)],
            capture_output=True, text=True, env=_env(), timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert lines[-1] == f"{len(TRACES)} passed, 0 failed"
        with KVCoordClient(server.address) as c:
            assert list(c.list_pools().pools) == []  # every trace's pool was deleted
    finally:
        server.stop()


def test_four_worker_processes_share_one_pool() -> None:
    """Concurrent workers never hold a block twice unless shared through the prefix cache,
    and every block is free again once all requests are freed."""
    server = start_server("", env=_env())
    try:
        with KVCoordClient(server.address) as c:
            c.create_pool("shared", pool_config(120))
        report = run_many_workers(server.address, "shared", num_workers=4, steps=80)
        errors = [r["error"] for r in report["results"] if r["error"]]
        assert not errors, errors
        total = {
            k: sum(r[k] for r in report["results"])
            for k in ("allocs", "refusals", "hit_tokens", "preemptions")
        }
        assert total["allocs"] > 100 and total["refusals"] > 0 and total["hit_tokens"] > 0, total
        assert report["busy_samples"] >= 3, report["samples"]
        final = report["final"]
        assert final.num_requests == 0 and final.num_free_blocks == report["num_blocks"] - 1
        assert report["reset"] is True
    finally:
        server.stop()
