"""scripts/count_lines.py, which issue 21's size figures come from: what counts as a
code line, and a package counted as it was at a git revision."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_lines.py"
spec = importlib.util.spec_from_file_location("count_lines", SCRIPT)
assert spec is not None and spec.loader is not None
count_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(count_lines)

SOURCE = '''"""A module docstring
over two lines."""

# a comment
import os


def f(x):
    """A docstring."""
    return (x +
            1)  # a trailing comment
'''


def test_blank_lines_comments_and_docstrings_are_not_code() -> None:
    # import os; def f(x):; return (x +; 1)
    assert count_lines.count(SOURCE) == (11, 4)


def test_a_package_is_counted_as_it_was_at_a_revision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(SOURCE)
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one module")
    (pkg / "b.py").write_text("x = 1\n")  # after the commit: not in it
    (pkg / "a.py").write_text("y = 2\n")

    monkeypatch.chdir(tmp_path)
    assert count_lines.main(["pkg", "--at", "HEAD"]) == 0
    at_head = capsys.readouterr().out.splitlines()
    assert count_lines.main(["pkg"]) == 0
    now = capsys.readouterr().out.splitlines()
    assert [line.split() for line in at_head] == [["a.py", "11", "4"], ["total", "11", "4"]]
    assert [line.split() for line in now] == [["a.py", "1", "1"], ["b.py", "1", "1"], ["total", "2", "2"]]
