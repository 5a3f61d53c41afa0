"""Run the decode fast paths' differential fuzz (tests/fastpath_diff.py) longer than the
suite does: every layout (or those named) for SEEDS seeds of STEPS scheduler steps.

    python bench/fastpath_diff.py --seeds 20 --steps 2000
    python bench/fastpath_diff.py --first-seed 100 --seeds 5 full4 full4+swa4w8

Not a test. Prints each failing (layout, seed) with its first lines (rerun it alone to
see all), then the differential calls made and the time. Exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT_DIR / "client"), str(ROOT_DIR / "server"), str(ROOT_DIR / "tests")]

from fastpath_diff import LAYOUTS, Diff  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("layouts", nargs="*", help=f"layouts (default: all): {', '.join(LAYOUTS)}")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts: {', '.join(unknown)}")
    start = time.perf_counter()
    calls = failed = 0
    for name in args.layouts or LAYOUTS:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            d = Diff(name, seed)
            try:
                for _ in range(args.steps):
                    d.step()
            except Exception as err:  # noqa: BLE001 - every failure is reported
                failed += 1
                print(f"FAIL {name} seed {seed} after {d.calls} calls: {type(err).__name__}")
                print("".join(traceback.format_exception(err))[-3000:])
            calls += d.calls
    print(f"{calls:,} differential calls, {failed} failed runs, {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
