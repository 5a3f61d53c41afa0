"""kvcoord-client: the client as its own distribution, installable and type-checkable
without the server.

The slow test builds the wheel from client/ (a copy, so the tree gains no build/),
installs it with its `typing` extra into a fresh venv (dependencies from the package
index) and runs mypy there against two small worker scripts. Everything it writes is
under pytest's tmp_path (pip and mypy caches included); it takes about a minute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client"

# A worker's code, correct: mypy --strict passes and reveals the response types.
GOOD = """\
from kvcoord.client import AsyncKVCoordClient, KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb


def sync_use(client: KVCoordClient) -> int:
    reveal_type(client.get_pool("p"))
    step: pb.StepResponse = client.step("p", [], "session")
    return len(step.results) + client.get_stats("p").num_free_blocks


async def async_use(client: AsyncKVCoordClient) -> pb.AttachResponse:
    pending = reveal_type(client.get_pool("p"))
    reveal_type(await pending)
    return await client.attach("p", "sha256_cbor", 16, "0")
"""

# Wrong uses, one a line: each must be reported on its own line.
BAD = """\
from kvcoord.client import AsyncKVCoordClient, KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb


async def misuse(client: KVCoordClient, aio: AsyncKVCoordClient) -> None:
    client.get_pool(7)
    wrong: pb.AttachResponse = client.get_pool("p")
    print(client.get_pool("p").no_such_field)
    print((await aio.get_stats("p")).no_such_field)
    print(aio.get_stats("p").num_free_blocks)
"""
BAD_LINES = {6: "arg-type", 7: "assignment", 8: "attr-defined", 9: "attr-defined", 10: "attr-defined"}


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_client_distribution_matches_the_root_one() -> None:
    """Same version and python; its dependencies are the root's pins minus the server's;
    it ships exactly the client packages and the engine, each with py.typed."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text())
    rp, cp = root["project"], client["project"]
    assert cp["name"] == "kvcoord-client"
    assert (cp["version"], cp["requires-python"]) == (rp["version"], rp["requires-python"])
    server_only = {"grpcio-reflection>=1.85.1", "prometheus-client>=0.20", "structlog>=24.1"}
    assert set(cp["dependencies"]) == set(rp["dependencies"]) - server_only
    assert client["tool"]["setuptools"]["packages"] == [
        "kvcoord.client", "kvcoord.v1", "kvcoord.engine", "kvcoord.engine.managers", "kvcoord.wire"
    ]  # fmt: skip
    assert (CLIENT / "kvcoord" / "client" / "py.typed").exists()
    assert (CLIENT / "kvcoord" / "engine" / "py.typed").exists()
    assert "py.typed" in client["tool"]["setuptools"]["package-data"]["kvcoord.engine"]
    assert "py.typed" in root["tool"]["setuptools"]["package-data"]["kvcoord.engine"]
    assert (CLIENT / "kvcoord" / "v1" / "py.typed").exists()
    assert "py.typed" in root["tool"]["setuptools"]["package-data"]["kvcoord.client"]


def test_worker_installs_and_type_checks_the_client_alone(tmp_path: Path) -> None:
    """Built wheel -> fresh venv: kvcoord.client imports, no server package is there,
    and mypy --strict types every RPC with its response (and rejects wrong uses)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MYPY", "VIRTUAL_ENV"))}
    env.update(PIP_CACHE_DIR=str(tmp_path / "pip-cache"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    src = tmp_path / "src"
    shutil.copytree(CLIENT, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    dist = tmp_path / "dist"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", str(src), "-w", str(dist)], tmp_path, env, 300
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("kvcoord_client-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0] for n in names if not n.startswith("kvcoord_client-")}
    assert packages == {
        "kvcoord/client", "kvcoord/v1", "kvcoord/engine", "kvcoord/engine/managers", "kvcoord/wire"
    }, packages  # fmt: skip
    assert {"kvcoord/client/py.typed", "kvcoord/v1/py.typed", "kvcoord/v1/allocator_pb2.pyi"} <= set(names)

    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env, 120)
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    installed = _run([python, "-m", "pip", "install", f"{wheel}[typing]", "mypy"], tmp_path, env, 300)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    work = tmp_path / "work"  # outside the repository: nothing of it is on the path
    work.mkdir()
    probe = (
        "import importlib.util, sys, kvcoord.client, kvcoord.engine, kvcoord.v1.allocator_pb2_grpc\n"
        "from kvcoord.client import KVCoordClient, RemoteKVCacheManager, BlockHasher\n"
        "from kvcoord.engine.pool import KVCachePool\n"
        "assert kvcoord.client.__file__.startswith(sys.prefix), kvcoord.client.__file__\n"
        "assert kvcoord.engine.__file__.startswith(sys.prefix), kvcoord.engine.__file__\n"
        "for name in ('kvcoord.service', 'kvcoord.conformance', 'prometheus_client',\n"
        "             'grpc_reflection', 'structlog'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "print('client only')\n"
    )
    ran = _run([python, "-c", probe], work, env, 60)
    assert ran.returncode == 0 and "client only" in ran.stdout, ran.stdout + ran.stderr
    for name in ("service",):
        missing = _run([python, "-c", f"import kvcoord.{name}"], work, env, 60)
        assert "ModuleNotFoundError: No module named 'kvcoord." + name in missing.stderr, missing.stderr

    (work / "good.py").write_text(GOOD)
    (work / "bad.py").write_text(BAD)
    mypy = [python, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "mypy-cache")]
    good = _run([*mypy, "good.py"], work, env, 300)
    assert good.returncode == 0, good.stdout + good.stderr
    assert 'good.py:6: note: Revealed type is "kvcoord.v1.allocator_pb2.GetPoolResponse"' in good.stdout
    assert (
        'good.py:12: note: Revealed type is "typing.Coroutine[Any, Any, kvcoord.v1.allocator_pb2.GetPoolResponse]"'
        in good.stdout
    )
    assert 'good.py:13: note: Revealed type is "kvcoord.v1.allocator_pb2.GetPoolResponse"' in good.stdout
    bad = _run([*mypy, "bad.py"], work, env, 300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    reported = {
        int(line.split(":")[1]): line.rsplit("[", 1)[-1].rstrip("]")
        for line in bad.stdout.splitlines()
        if line.startswith("bad.py:") and ": error: " in line
    }
    assert reported == BAD_LINES, bad.stdout
