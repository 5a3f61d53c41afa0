"""Fuzzing in the suite: generated and mutated calls of every RPC against a live server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzing import CONFIG, ROOT, Call, Fuzzer, calls
from hypothesis import HealthCheck, given, settings
from kvcoord.conformance import load_trace, replay
from kvcoord.conformance.remote import RemoteTarget
from kvcoord.service.testing import InProcessServer

TRACES = sorted((Path(__file__).resolve().parents[1] / "conformance" / "data").glob("*.jsonl"))


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[InProcessServer]:
    server = InProcessServer(CONFIG).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fuzzer(fuzz_server: InProcessServer) -> Iterator[Fuzzer]:
    f = Fuzzer(fuzz_server.address)
    yield f
    f.close()


@settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(call=calls())
def test_every_call_gets_a_documented_status(fuzzer: Fuzzer, call: Call) -> None:
    """Any generated or mutated call of any RPC (and raw random bytes) is answered with a
    status of the proto's error model, never INTERNAL or UNKNOWN, and so is every
    operation of a Step."""
    assert fuzzer.run(call) == []


def test_after_fuzzing_pools_are_intact_and_traces_pass(fuzzer: Fuzzer, fuzz_server: InProcessServer) -> None:
    """After the fuzz run (the test above, on the same server): every pool passes
    CheckPool, and every vLLM conformance trace replays on that server exactly. (Under
    pytest-xdist the fuzz run may have gone to another worker: it is then run here.)"""
    if fuzzer.calls == 0:
        test_every_call_gets_a_documented_status(fuzzer=fuzzer)
    assert fuzzer.calls >= 400
    assert fuzzer.check_pools() == {name: [] for name in fuzzer.check_pools()}
    for path in TRACES:
        result = replay(load_trace(path), RemoteTarget(fuzz_server.address, token=ROOT))
        assert result.passed, f"{path.name}: {result.mismatch}"
    assert all(v == [] for v in fuzzer.check_pools().values())
