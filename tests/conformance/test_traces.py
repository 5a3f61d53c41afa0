"""Every public vLLM trace replays on the engine with identical answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvcoord.conformance import LocalTarget, load_trace, replay

DATA = Path(__file__).parent / "data"
TRACES = sorted(DATA.glob("*.jsonl"))
ROOT = Path(__file__).resolve().parents[2]


def test_all_public_traces_are_present() -> None:
    """The copied traces are the 19 of the manifest, byte for byte."""
    import hashlib

    manifest = json.loads((DATA / "MANIFEST.json").read_text())
    assert len(manifest["files"]) == len(TRACES) == 19
    for entry in manifest["files"]:
        assert hashlib.sha256((DATA / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_trace_replays_on_engine(path: Path) -> None:
    """Block ids, hits, events, stats and free-queue order equal vLLM's at every op."""
    result = replay(load_trace(path), LocalTarget())
    assert result.passed, str(result.mismatch)
    assert result.ops == len(path.read_text().splitlines()) - 1


@pytest.mark.parametrize(
    ("line", "field", "change"),
    [
        (None, "new_block_ids", lambda v: [list(reversed(x)) for x in v]),
        (None, "num_free_blocks", lambda v: v + 1),
        (None, "block_hashes", lambda v: v[:-1]),
    ],
)
def test_replayer_reports_a_changed_expectation(
    tmp_path: Path, line: int | None, field: str, change: object
) -> None:
    """A trace with one altered expectation fails at exactly that line and field."""
    src = (DATA / "hybrid_full16_swa16_w64.jsonl").read_text().splitlines()
    for i, text in enumerate(src[1:], start=1):
        rec = json.loads(text)
        value = rec.get("expect", {}).get(field)
        if value and (
            not isinstance(value, list)
            or any(len(x) > 1 for x in value if isinstance(x, list))
            or field == "block_hashes"
        ):
            rec["expect"][field] = change(value)  # type: ignore[operator]
            src[i] = json.dumps(rec)
            break
    else:
        pytest.fail(f"no op with {field}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(src) + "\n")
    result = replay(load_trace(bad), LocalTarget())
    assert not result.passed
    assert result.mismatch is not None
    assert (result.mismatch.line, result.mismatch.field) == (i + 1, field)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": f"{ROOT / 'client'}:{ROOT / 'server'}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "kvcoord.conformance", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


def test_cli_passes_every_trace() -> None:
    """`kvcoord conformance FILE...` prints a line per trace and 'N passed, 0 failed'."""
    proc = _cli(*map(str, TRACES))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum(line.startswith("PASS ") for line in lines) == len(TRACES)
    assert lines[-1] == f"{len(TRACES)} passed, 0 failed"


def test_cli_reports_failure_and_exits_nonzero(tmp_path: Path) -> None:
    """A failing or unreadable trace gives a FAIL line with the mismatch and exit 1."""
    src = (DATA / "unitary_full16_tiny.jsonl").read_text().splitlines()
    idx = next(i for i, t in enumerate(src) if '"op":"allocate_slots"' in t)
    rec = json.loads(src[idx])
    rec["expect"]["num_free_blocks"] = -1
    src[idx] = json.dumps(rec)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(src))
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    proc = _cli(str(TRACES[0]), str(bad), str(garbage))
    assert proc.returncode == 1
    out = proc.stdout.splitlines()
    assert out[0].startswith("PASS ")
    assert out[1].startswith(f"FAIL unitary_full16_tiny: line {idx + 1} op allocate_slots req ")
    assert "num_free_blocks: expected -1" in out[1]
    assert out[2].startswith(f"FAIL {garbage}")
    assert out[-1] == "1 passed, 2 failed"
