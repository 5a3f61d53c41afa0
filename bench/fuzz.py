"""Run the suite's RPC fuzzer (tests/fuzzing.py) for a given number of inputs.

    python bench/fuzz.py 100000

Not a test. Starts an in-process server with the fuzz configuration (tenants, two
pools), sends COUNT generated calls (every RPC, mutated fields, raw bytes, any
tenant's token), then checks every pool with CheckPool and replays every vLLM
conformance trace on the same server. Prints the statuses seen, any call answered
with an undocumented status (INTERNAL, UNKNOWN, ...), the violations and the time.
Exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT_DIR / "client"), str(ROOT_DIR / "server"), str(ROOT_DIR / "tests")]

from fuzzing import CONFIG, ROOT, Call, Fuzzer, calls  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from kvcoord.conformance import load_trace, replay  # noqa: E402
from kvcoord.conformance.remote import RemoteTarget  # noqa: E402
from kvcoord.service.testing import InProcessServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("count", type=int, nargs="?", default=10_000, help="inputs to send")
    args = parser.parse_args()
    server = InProcessServer(CONFIG, metrics=False).start()
    fuzzer = Fuzzer(server.address)
    failures: list[str] = []
    started = time.perf_counter()

    @settings(
        max_examples=args.count,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(call=calls())
    def drive(call: Call) -> None:
        problems = fuzzer.run(call)
        failures.extend(problems)
        if fuzzer.calls % 10_000 == 0:
            print(f"  {fuzzer.calls} inputs, {time.perf_counter() - started:.0f} s", file=sys.stderr)

    try:
        drive()
        fuzz_seconds = time.perf_counter() - started
        violations = {k: v for k, v in fuzzer.check_pools().items() if v}
        traces = sorted((ROOT_DIR / "tests" / "conformance" / "data").glob("*.jsonl"))
        mismatches = []
        for path in traces:
            result = replay(load_trace(path), RemoteTarget(server.address, token=ROOT))
            if not result.passed:
                mismatches.append(f"{path.name}: {result.mismatch}")
    finally:
        fuzzer.close()
        server.stop()
    total = time.perf_counter() - started
    print(f"inputs: {fuzzer.calls} in {fuzz_seconds:.1f} s ({fuzzer.calls / fuzz_seconds:.0f}/s)")
    for kind in ("call", "op"):
        seen = sorted(((n, c) for (k, n), c in fuzzer.seen.items() if k == kind), key=lambda x: -x[1])
        print(f"{kind} statuses: " + ", ".join(f"{n} {c}" for n, c in seen))
    print(f"undocumented statuses: {len(failures)}")
    for f in failures[:20]:
        print("  ", f)
    print(f"pools with invariant violations: {len(violations)} {violations if violations else ''}")
    print(f"conformance traces after fuzzing: {len(traces) - len(mismatches)}/{len(traces)} passed")
    for m in mismatches:
        print("  ", m)
    print(f"total {total:.1f} s")
    return 1 if failures or violations or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
