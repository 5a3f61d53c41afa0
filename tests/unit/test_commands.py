"""The ``kvcoord`` command is kvcoord-client's; other distributions add commands through
the entry-point group ``kvcoord.commands`` (the server's ``serve``, the replayer's
``conformance``), and nothing of the server is imported to run a client command.

The subprocess tests put the entry points both pyproject.toml files declare on the
path as an installed distribution's metadata (a ``*.dist-info`` directory), so the real
``importlib.metadata`` discovery runs against the real declarations. Installing both
wheels for real: tests/unit/test_client_distribution.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from kvcoord.client.cli import COMMANDS_GROUP, CommandGroup, cli

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "conformance" / "data" / "unitary_full16_tiny.jsonl"


def _declared() -> dict[str, str]:
    """Every ``kvcoord.commands`` entry point the two distributions declare."""
    out: dict[str, str] = {}
    for pyproject in (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        out.update(project.get("entry-points", {}).get(COMMANDS_GROUP, {}))
    return out


def _metadata_dir(tmp_path: Path, entry_points: dict[str, str]) -> Path:
    info = tmp_path / "site" / "kvcoord_commands_probe-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcoord-commands-probe\nVersion: 0.0\n")
    body = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{COMMANDS_GROUP}]\n{body}")
    return info.parent


def _kvcoord(site: Path, *args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KVCOORD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "client"), str(ROOT / "server")])
    argv = ["-c", code] if code is not None else ["-m", "kvcoord.client.cli", *args]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120)


def test_each_distribution_declares_its_commands() -> None:
    assert _declared() == {
        "serve": "kvcoord.service.cli:serve",
        "conformance": "kvcoord.conformance.cli:conformance",
    }
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "scripts" not in root, "the kvcoord script is kvcoord-client's alone (two would clash)"
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert client["scripts"] == {"kvcoord": "kvcoord.client.cli:main"}


def test_the_client_script_runs_the_servers_serve(tmp_path: Path) -> None:
    from kvcoord.service.config import default_config_text

    site = _metadata_dir(tmp_path, _declared())
    proc = _kvcoord(site, "serve", "--print-default-config")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == default_config_text().strip()


def test_the_client_script_runs_conformance(tmp_path: Path) -> None:
    site = _metadata_dir(tmp_path, _declared())
    proc = _kvcoord(site, "conformance", str(TRACE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "1 passed, 0 failed"


def test_help_lists_added_commands_without_importing_them(tmp_path: Path) -> None:
    site = _metadata_dir(tmp_path, _declared())
    code = (
        "import sys\n"
        "from kvcoord.client.cli import main\n"
        "status = main(['--help'])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('kvcoord.service', 'kvcoord.conformance')))\n"
        "print('LOADED', loaded)\n"
        "sys.exit(status)\n"
    )
    proc = _kvcoord(site, code=code)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
    listed = {line.split()[0] for line in proc.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert {"serve", "conformance", "status", "health"} <= listed, proc.stdout


def test_a_command_that_cannot_be_loaded_fails_in_one_line(tmp_path: Path) -> None:
    site = _metadata_dir(tmp_path, {"broken": "kvcoord.no_such_module:command"})
    proc = _kvcoord(site, "broken")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        "kvcoord: command 'broken' (kvcoord.no_such_module:command) cannot be loaded"
    )
    assert "Traceback" not in proc.stderr
    assert _kvcoord(site, "health", "--target", "127.0.0.1:1", "--timeout", "0.2").returncode == 1


def test_a_built_in_command_keeps_its_name() -> None:
    """An entry point named like a client command does not replace it."""
    from importlib.metadata import EntryPoint

    group = CommandGroup(
        entry_points=[
            EntryPoint("status", "kvcoord.service.cli:serve", COMMANDS_GROUP),
            EntryPoint("serve", "kvcoord.service.cli:serve", COMMANDS_GROUP),
        ],
        commands=dict(cli.commands),
    )
    ctx = click.Context(group)
    assert group.get_command(ctx, "status") is cli.commands["status"]
    assert group.list_commands(ctx) == sorted({*cli.commands, "serve"})
    result = CliRunner().invoke(group, ["status", "--help"])
    assert result.exit_code == 0 and "--target" in result.output


@pytest.mark.parametrize(
    ("argv", "said"), [(["--help"], "serve"), (["serve", "--print-default-config"], "[server]")]
)
def test_the_servers_module_runs_serve_alone(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m kvcoord.service.cli serve`` (source trees, tests) needs no client."""
    from kvcoord.service.cli import main

    assert main(argv) == 0
    assert said in capsys.readouterr().out
