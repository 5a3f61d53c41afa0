"""The engine's rules fingerprint (kvcoord.wire.rules) names exactly its sources: a
copy of the engine gives the same fingerprint, and a one-character change to any rule
gives another (so a mirror never answers for a server whose engine decides otherwise)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _fingerprint(client_root: Path) -> str:
    """The fingerprint a process importing the client (and engine) from ``client_root`` sees."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvcoord.wire.rules import rules_fingerprint; print(rules_fingerprint())",
        ],
        env={"PYTHONPATH": str(client_root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout.strip()


def test_a_changed_rule_changes_the_fingerprint(tmp_path: Path) -> None:
    copy = tmp_path / "client"
    shutil.copytree(ROOT / "client", copy, ignore=shutil.ignore_patterns("__pycache__"))
    ours = _fingerprint(ROOT / "client")
    assert ours.startswith("state") and ours == _fingerprint(copy)  # where it lives does not count
    rule = copy / "kvcoord" / "engine" / "managers" / "sliding_window.py"
    text = rule.read_text()
    assert "- self.sliding_window + 1" in text
    rule.write_text(text.replace("- self.sliding_window + 1", "- self.sliding_window + 2", 1))
    assert _fingerprint(copy) != ours
