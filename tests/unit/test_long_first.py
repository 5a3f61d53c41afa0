"""The order tests/conftest.py gives an xdist run (tests/long_first.py), fed to xdist's own schedulers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from long_first import loadfile_order, worksteal_order, worksteal_shares
from xdist.scheduler import LoadFileScheduling, WorkStealingScheduling

TESTS = Path(__file__).resolve().parents[1]


@dataclass(eq=False)
class _Node:
    """What xdist's schedulers use of a worker: the tests sent to it, in order."""

    name: str
    gateway: SimpleNamespace = field(init=False)
    sent: list[int] = field(default_factory=list)
    shutting_down: bool = False

    def __post_init__(self) -> None:
        self.gateway = SimpleNamespace(id=self.name)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _config(workers: int) -> SimpleNamespace:
    values = {"tx": [f"{workers}*popen"], "numprocesses": workers}
    return SimpleNamespace(getvalue=values.get, option=SimpleNamespace(loadscopereorder=False))


def _first_shares(
    scheduler: WorkStealingScheduling | LoadFileScheduling, collection: list[str], workers: int
) -> list[list[str]]:
    nodes = [_Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    return [[collection[i] for i in node.sent] for node in nodes]


def _suite(files: int, tests: int, long_tests: set[tuple[int, int]]) -> list[str]:
    """Node ids f{file}.py::t{test}, the long ones named ...::long{test}."""
    return [
        f"f{f}.py::{'long' if (f, t) in long_tests else 't'}{t}" for f in range(files) for t in range(tests)
    ]


def _is_long(nodeid: str) -> bool:
    return "::long" in nodeid


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_every_worksteal_worker_starts_with_its_share_of_the_long_tests(workers: int) -> None:
    """Long tests that sat together in one file (the last worker's share) start first, spread over the workers."""
    suite = _suite(10, 30, {(9, t) for t in range(0, 30, 3)})  # 10 long tests, all in the last file
    ordered = worksteal_order(suite, _is_long, workers)
    assert sorted(ordered) == sorted(suite)
    shares = _first_shares(WorkStealingScheduling(_config(workers)), ordered, workers)  # type: ignore[arg-type]
    longs_per_share = []
    for share in shares:
        leading = len(share) - len([t for t in share if not _is_long(t)])
        assert all(_is_long(t) for t in share[:leading]), share[: leading + 1]
        longs_per_share.append(leading)
    assert sum(longs_per_share) == 10
    assert max(longs_per_share) - min(longs_per_share) <= 1, longs_per_share
    # the short tests keep their collection order
    assert [t for t in ordered if not _is_long(t)] == [t for t in suite if not _is_long(t)]


def test_worksteal_shares_are_the_ones_xdist_sends() -> None:
    """The share sizes long_first computes are those of xdist's first distribution."""
    suite = [f"f.py::t{i}" for i in range(103)]
    shares = _first_shares(WorkStealingScheduling(_config(4)), suite, 4)  # type: ignore[arg-type]
    assert [len(s) for s in shares] == worksteal_shares(103, 4) == [25, 26, 26, 26]


def test_too_many_long_tests_keep_the_collection_order() -> None:
    """Where long tests would fill a worker's whole share, nothing is moved."""
    suite = _suite(1, 5, {(0, 0), (0, 1), (0, 2), (0, 3)})
    assert worksteal_order(suite, _is_long, 2) == suite
    assert worksteal_order(_suite(2, 3, set()), _is_long, 2) == _suite(2, 3, set())


def test_loadfile_hands_out_the_files_holding_a_long_test_first() -> None:
    """With --no-loadscope-reorder xdist sends whole files in the order given: long files first."""
    suite = _suite(6, 3, {(2, 1), (5, 0)})
    ordered = loadfile_order(suite, _is_long, lambda nodeid: nodeid.split("::")[0])
    assert [t.split("::")[0] for t in ordered[:6]] == ["f2.py"] * 3 + ["f5.py"] * 3
    assert sorted(ordered) == sorted(suite)
    shares = _first_shares(LoadFileScheduling(_config(2)), ordered, 2)  # type: ignore[arg-type]
    assert [s[0].split("::")[0] for s in shares] == ["f2.py", "f5.py"]
    assert all(len({t.split("::")[0] for t in s}) == 1 for s in shares)  # whole files, one per worker


_CONFTEST = """\
import importlib.util

_spec = importlib.util.spec_from_file_location("kvcoord_conftest", {path!r})
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
pytest_configure_node = _suite.pytest_configure_node
pytest_collection_modifyitems = _suite.pytest_collection_modifyitems
"""


def _first_tests_per_worker(project: Path, *args: str) -> dict[str, list[str]]:
    """Run pytest-xdist over ``project`` (the suite's own hooks): each worker's tests, in the order run."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:benchmark", *args],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    ran: dict[str, list[str]] = {}
    for worker, nodeid in re.findall(r"^\[(gw\d+)\] \[ *\d+%\] PASSED (\S+)", run.stdout, re.MULTILINE):
        ran.setdefault(worker, []).append(nodeid)
    return ran


def _project(tmp_path: Path, long_file: str, long_names: range) -> Path:
    (tmp_path / "conftest.py").write_text(_CONFTEST.format(path=str(TESTS / "conftest.py")))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    long: a long test\n")
    for name in ("a", "b", "c", "d"):
        lines = ["import pytest", ""]
        for i in range(10):
            if name == long_file and i in long_names:
                lines.append("@pytest.mark.long")
            lines += [f"def test_{i}():", "    pass", ""]
        (tmp_path / f"test_{name}.py").write_text("\n".join(lines))
    return tmp_path


def test_an_xdist_run_starts_its_long_tests_first_on_every_worker(tmp_path: Path) -> None:
    """Through the suite's conftest: worksteal workers start with long tests, loadfile with a long file."""
    project = _project(tmp_path, "d", range(6, 10))  # collected last: the second worker's share's end
    ran = _first_tests_per_worker(project, "-n", "2", "--dist", "worksteal")
    assert sorted(ran) == ["gw0", "gw1"]
    for worker, tests in ran.items():
        assert all(t.startswith("test_d.py::test_") and int(t[-1]) >= 6 for t in tests[:2]), (worker, tests)
    ran = _first_tests_per_worker(project, "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")
    assert sorted(t[0] for t in ran.values()) == ["test_a.py::test_0", "test_d.py::test_0"], ran
