"""kvcoord-client: the client as its own distribution (client, engine, wire, the
conformance replayer and the `kvcoord` command), installable and type-checkable without
the server; the server's distribution (kvcoord.service alone) depends on it.

The slow test builds both wheels (from copies, so the tree gains no build/), installs
the client's with its `typing` extra into a fresh venv (dependencies from the package
index), runs mypy there against two small worker scripts, then adds the server's wheel
and runs `kvcoord serve` through the client's command. Everything it writes is under
pytest's tmp_path (pip and mypy caches included); it takes a minute or two.
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


def test_the_server_distribution_depends_on_the_client_one() -> None:
    """Same version and python; the server's dependencies are the client distribution
    (same version) plus what only the server needs; each package is in exactly one of
    the two, with py.typed where it is typed."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text())
    rp, cp = root["project"], client["project"]
    assert cp["name"] == "kvcoord-client"
    assert (cp["version"], cp["requires-python"]) == (rp["version"], rp["requires-python"])
    server_only = {"grpcio-reflection>=1.85.1", "prometheus-client>=0.20", "structlog>=24.1"}
    assert set(rp["dependencies"]) == {f"kvcoord-client=={cp['version']}"} | server_only
    assert not server_only & set(cp["dependencies"])
    assert root["tool"]["setuptools"]["packages"] == ["kvcoord.service"]
    assert client["tool"]["setuptools"]["packages"] == [
        "kvcoord.client", "kvcoord.v1", "kvcoord.engine", "kvcoord.engine.managers", "kvcoord.wire",
        "kvcoord.conformance",
    ]  # fmt: skip
    for package in ("client", "engine", "wire", "v1"):
        assert (CLIENT / "kvcoord" / package / "py.typed").exists(), package
        assert "py.typed" in client["tool"]["setuptools"]["package-data"][f"kvcoord.{package}"], package


def _wheel(source: Path, into: Path, name: str, tmp_path: Path, env: dict[str, str]) -> Path:
    """The wheel of ``source``, built from a copy (the tree gains no build/)."""
    src = tmp_path / f"src-{name}"
    shutil.copytree(source, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", ".*"))
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", str(src), "-w", str(into)], tmp_path, env, 300
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = into.glob(f"{name}-*.whl")
    return wheel


def _packages(wheel: Path) -> tuple[set[str], list[str]]:
    names = zipfile.ZipFile(wheel).namelist()
    return {n.rsplit("/", 1)[0] for n in names if ".dist-info/" not in n}, names


def test_worker_installs_and_type_checks_the_client_alone(tmp_path: Path) -> None:
    """Both wheels built; the client's into a fresh venv: client, engine and wire import,
    no server package is there, and mypy --strict types every RPC with its response (and
    rejects wrong uses). Then the server's wheel, whose only kvcoord dependency is the
    client's: the client's `kvcoord` command runs the server's `serve`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MYPY", "VIRTUAL_ENV"))}
    env.update(PIP_CACHE_DIR=str(tmp_path / "pip-cache"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    dist = tmp_path / "dist"
    wheel = _wheel(CLIENT, dist, "kvcoord_client", tmp_path, env)
    packages, names = _packages(wheel)
    assert packages == {
        "kvcoord/client", "kvcoord/v1", "kvcoord/engine", "kvcoord/engine/managers", "kvcoord/wire",
        "kvcoord/conformance",
    }, packages  # fmt: skip
    assert {"kvcoord/client/py.typed", "kvcoord/v1/py.typed", "kvcoord/v1/allocator_pb2.pyi"} <= set(names)
    assert {"kvcoord/engine/py.typed", "kvcoord/wire/py.typed"} <= set(names)
    server_src = tmp_path / "server-tree"  # the root project without client/ (it must not need it)
    server_src.mkdir()
    for part in ("pyproject.toml", "README.md", "server"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, server_src / part)
    server_wheel = _wheel(server_src, dist, "kvcoord", tmp_path, env)
    server_packages, server_names = _packages(server_wheel)
    assert server_packages == {"kvcoord/service"}, server_packages
    (meta,) = [n for n in server_names if n.endswith(".dist-info/METADATA")]
    requires = [
        line.split(":", 1)[1].strip()
        for line in zipfile.ZipFile(server_wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert "kvcoord-client==0.1.0" in requires, requires

    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env, 120)
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    installed = _run([python, "-m", "pip", "install", f"{wheel}[typing]", "mypy"], tmp_path, env, 300)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    work = tmp_path / "work"  # outside the repository: nothing of it is on the path
    work.mkdir()
    probe = (
        "import importlib.util, sys, kvcoord.client, kvcoord.engine, kvcoord.wire, kvcoord.v1.allocator_pb2_grpc\n"
        "from kvcoord.client import KVCoordClient, RemoteKVCacheManager, BlockHasher\n"
        "from kvcoord.engine.pool import KVCachePool\n"
        "from kvcoord.wire import config_from_pb, events_digest\n"
        "for m in (kvcoord.client, kvcoord.engine, kvcoord.wire):\n"
        "    assert m.__file__.startswith(sys.prefix), m.__file__\n"
        "for name in ('kvcoord.service', 'prometheus_client', 'grpc_reflection', 'structlog'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "print('client only')\n"
    )
    ran = _run([python, "-c", probe], work, env, 60)
    assert ran.returncode == 0 and "client only" in ran.stdout, ran.stdout + ran.stderr
    missing = _run([python, "-c", "import kvcoord.service"], work, env, 60)
    assert "ModuleNotFoundError: No module named 'kvcoord.service" in missing.stderr, missing.stderr
    kvcoord = str(venv / "bin" / "kvcoord")
    alone = _run([kvcoord, "serve", "--help"], work, env, 60)
    assert alone.returncode == 2 and "No such command 'serve'" in alone.stderr, alone.stdout + alone.stderr
    replayer = _run([kvcoord, "conformance", "--help"], work, env, 60)
    assert replayer.returncode == 0 and "--target" in replayer.stdout, replayer.stdout + replayer.stderr

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

    # The server's wheel next to it: pip takes kvcoord-client from the installed one.
    server = _run(
        [python, "-m", "pip", "install", "--find-links", str(dist), str(server_wheel)], work, env, 300
    )
    assert server.returncode == 0, server.stdout[-3000:] + server.stderr[-3000:]
    config = _run([kvcoord, "serve", "--print-default-config"], work, env, 60)
    assert config.returncode == 0 and "[server]" in config.stdout, config.stdout + config.stderr
    listed = _run([kvcoord, "--help"], work, env, 60)
    assert "serve" in listed.stdout and "conformance" in listed.stdout, listed.stdout
