"""Run layouts_faults cases from the command line (the review's matrix), one line each:

    cd <worktree> && PYTHONHASHSEED=0 $V/bin/python tests/with_vllm/layouts_matrix.py \\
        'Case("sync", "full+chunked", "predicted", "lost", 7, connector="FailedRecvingConnector")' ...

Prints "ok" or "FAIL" per case with its oracle summary, and the problems found."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "client"), str(HERE.parents[1] / "server")]
os.environ.setdefault("PYTHONHASHSEED", "0")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR)
    from harness import write_model_dir
    from layouts_faults import Case, run_case

    base = Path(tempfile.mkdtemp(prefix="layouts-"))
    model_dir = write_model_dir(base / "model")
    failed = 0
    for i, text in enumerate(argv):
        case = eval(text, {"Case": Case})  # noqa: S307 - the operator's own case lines
        started = time.monotonic()
        tmp = base / f"c{i}"
        tmp.mkdir()
        try:
            problems = run_case(case, model_dir, tmp)
        except Exception as err:  # noqa: BLE001 - reported
            problems = [f"raised {type(err).__name__}: {err}"]
        first = case.results[0]["oracle"].summary() if case.results else None
        lost = [getattr(r["manager"], "lost_requests", None) for r in case.results]
        print(f"{'FAIL' if problems else 'ok  '} {case!r} {time.monotonic() - started:.0f}s lost={lost} "
              f"met={case.injected.get('met')} kills={case.injected.get('kills')} "
              f"counts={case.injected.get('counts')} oracle0={first}", flush=True)  # fmt: skip
        for p in problems[:6]:
            print("    ", p[:1500], flush=True)
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
