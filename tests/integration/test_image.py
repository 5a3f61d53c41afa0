"""The image as a real container: metadata, no compilers, a mounted config, SIGTERM.
Collected only when KVCOORD_IMAGE names the image under test."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

from conftest import http_get, wait_for
from kvcoord.client import KVCoordClient

IMAGE = os.environ.get("KVCOORD_IMAGE", "")


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def test_image_metadata() -> None:
    """Non-root user, gRPC health check, both ports exposed, `kvcoord serve` by default."""
    cfg = json.loads(docker("image", "inspect", IMAGE).stdout)[0]["Config"]
    assert cfg["User"] == "10001:10001"
    assert cfg["Healthcheck"]["Test"][1:] == ["kvcoord", "health", "--target", "127.0.0.1:50051"]
    assert set(cfg["ExposedPorts"]) == {"50051/tcp", "9400/tcp"}
    assert cfg["Entrypoint"] == ["kvcoord"] and cfg["Cmd"] == ["serve"]


def test_no_compiler_in_the_final_image() -> None:
    """The final stage has no C compiler."""
    proc = docker(
        "run", "--rm", "--entrypoint", "sh", IMAGE, "-c", "command -v gcc || command -v cc || echo none"
    )
    assert proc.stdout.strip() == "none", proc.stdout


def test_the_ci_container_is_healthy() -> None:
    """Docker's HEALTHCHECK (gRPC health) reports the running container healthy."""
    name = os.environ["KVCOORD_CONTAINER"]
    status = wait_for(
        lambda: docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip() == "healthy"
    )
    assert status


def test_mounted_config_file_and_graceful_stop(tmp_path: Path) -> None:
    """A mounted TOML named by KVCOORD_CONFIG declares the pools; docker stop exits 0."""
    cfg = tmp_path / "kvcoord.toml"
    cfg.write_text(
        '[[pools]]\nname = "mounted"\nnum_blocks = 128\nhash_block_size = 16\nhash_algo = "sha256_cbor"\n'
        'hash_seed = "0"\nenable_caching = true\n\n[[pools.groups]]\ntype = "full"\nblock_size = 16\n'
    )
    cfg.chmod(0o644)
    name = f"kvcoord-cfg-{uuid.uuid4().hex[:6]}"
    run = docker("run", "-d", "--name", name, "-p", "127.0.0.1::50051", "-v", f"{cfg}:/etc/kvcoord/kvcoord.toml:ro",
                 "-e", "KVCOORD_CONFIG=/etc/kvcoord/kvcoord.toml", IMAGE)  # fmt: skip
    assert run.returncode == 0, run.stderr
    try:
        port = docker("port", name, "50051/tcp").stdout.strip().splitlines()[0].rsplit(":", 1)[1]
        with KVCoordClient(f"127.0.0.1:{port}", timeout=5) as c:

            def pools() -> list[str] | None:
                try:
                    return [p.name for p in c.list_pools().pools]
                except Exception:  # noqa: BLE001 - still starting
                    return None

            assert wait_for(pools, timeout=60) == ["mounted"]
        t0 = time.monotonic()
        assert docker("stop", "-t", "20", name).returncode == 0
        assert time.monotonic() - t0 < 20  # it stopped on SIGTERM, not by the kill after the grace
        assert docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip() == "0"
        # the image logs JSON lines (KVCOORD_LOG_FORMAT=json) on stderr
        logs = docker("logs", name)
        events = [json.loads(line) for line in logs.stderr.splitlines() if line.strip()]
        assert events[-1]["event"] == "kvcoord stopped" and events[-1]["logger"] == "kvcoord.lifecycle"
        assert any(
            e["event"].startswith("created pool mounted ") and e.get("pool") == "mounted" for e in events
        )
    finally:
        docker("rm", "-f", name)


def test_metrics_reach_a_scraper_in_another_container() -> None:
    """Issue 26: the image exposed 9400 but served /metrics on the container's loopback.
    Run with no settings (`docker run -P IMAGE`, on a network as compose would), /metrics
    answers a scraper in another container at `<name>:9400`, and the published host
    port; gRPC answers on its published port as before."""
    name = f"kvcoord-metrics-{uuid.uuid4().hex[:6]}"
    network = f"{name}-net"
    assert docker("network", "create", network).returncode == 0
    try:
        run = docker("run", "-d", "--name", name, "--network", network, "-P", IMAGE)
        assert run.returncode == 0, run.stderr
        assert wait_for(
            lambda: docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip() == "healthy",
            timeout=90,
        )
        scrape = f"import urllib.request; print(urllib.request.urlopen('http://{name}:9400/metrics', timeout=10).read().decode())"
        other = docker("run", "--rm", "--network", network, "--entrypoint", "python3", IMAGE, "-c", scrape)
        assert other.returncode == 0, other.stderr
        assert 'kvcoord_blocks_usable{pool="default"}' in other.stdout

        def published(port: str) -> str:
            return docker("port", name, port).stdout.strip().splitlines()[0].rsplit(":", 1)[1]

        assert 'kvcoord_blocks_usable{pool="default"}' in http_get(
            f"http://127.0.0.1:{published('9400/tcp')}/metrics"
        )
        with KVCoordClient(f"127.0.0.1:{published('50051/tcp')}", timeout=10) as c:
            assert [p.name for p in c.list_pools().pools] == ["default"]
    finally:
        docker("rm", "-f", name)
        docker("network", "rm", network)
