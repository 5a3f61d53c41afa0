"""The vLLM 0.33.0 traces (format 2) replay on the `vllm-0.33` profile, in-process and
over the wire; mamba layouts kvcoord does not model are refused loudly."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcoord.conformance import LocalTarget, load_trace, replay
from kvcoord.conformance.remote import RemoteTarget
from kvcoord.service.testing import InProcessServer

DATA = Path(__file__).parent / "data-vllm-0.33"
TRACES = {p.stem: p for p in sorted(DATA.glob("*.jsonl"))}

#: Traces that pass exactly, events and statistics included.
PASSING = [
    "nocache_full16",
    "nocache_full16_swa16_w64",
    "encdec_full16_cross16_nocache",
    "unitary_full16_large",
    "unitary_full16_tiny",
    "unitary_full16_sha256_lora_salt",
    "unitary_full16_eagle_k3",
    "unitary_full16_pd_connector",
    "hybrid_full16_swa16_w64",
    "hybrid_full16_swa16_w128_tiny",
    "hybrid_full16_swa16_w32_swa16_w128",
    "hybrid_full16_swa32_w128",
    "hybrid_full16_swa48_w96_tiny",
    "hybrid_full16_swa16_w64_eagle_k2",
    "hybrid_full16_chunked16_c64",
    "hybrid_full16_full32_swa16_w64",
    "hybrid_full32_mamba32_align",
]


def test_all_033_traces_are_present() -> None:
    """The copied traces are the 17 of the manifest, byte for byte, and each is either
    passing."""
    manifest = json.loads((DATA / "MANIFEST.json").read_text())
    assert manifest["vllm_version"] == "0.33.0"
    assert len(manifest["files"]) == len(TRACES) == 17
    for entry in manifest["files"]:
        assert hashlib.sha256((DATA / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]
    assert sorted(PASSING) == sorted(TRACES)


@pytest.mark.parametrize("name", PASSING)
def test_033_trace_replays_on_engine(name: str) -> None:
    """Block ids, hits, events, stats and free-queue order equal vLLM 0.33's at every op."""
    trace = load_trace(TRACES[name])
    assert trace.format_version == 2
    result = replay(trace, LocalTarget())
    assert result.passed, str(result.mismatch)
    assert result.ops == len(TRACES[name].read_text().splitlines()) - 1


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("name", PASSING)
def test_033_trace_replays_over_the_wire(server: InProcessServer, name: str) -> None:
    """The same answers through the client, a real gRPC server and a vllm-0.33 pool."""
    result = replay(load_trace(TRACES[name]), RemoteTarget(server.address))
    assert result.passed, str(result.mismatch)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"block_size": 64}, "copy-on-write"),  # sub-block hits: mamba block > hash block
        ({"mamba_cache_mode": "none"}, "requires 'align'"),  # 0.33 caches mamba only in align
    ],
)
def test_033_mamba_layouts_not_modelled_are_refused_loudly(change: dict[str, object], reason: str) -> None:
    """The mamba trace's layout with what the profile does not model: the pool is refused
    with the reason before any answer, never answered with a silently different block."""
    trace = load_trace(TRACES["hybrid_full32_mamba32_align"])
    config = copy.deepcopy(trace.config)
    config["groups"][1].update(change)
    result = replay(dataclasses.replace(trace, config=config), LocalTarget())
    assert result.mismatch is not None
    assert (result.mismatch.line, result.mismatch.field) == (1, "exception"), str(result.mismatch)
    assert reason in str(result.mismatch.got)
