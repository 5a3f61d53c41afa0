"""vLLM 0.16.0's schedulers on kvcoord while things go wrong: answers dropped, late,
duplicated and re-delivered on the wire; the server killed (SIGKILL) and restarted
from its journal between steps and during them. Decisions stay vLLM's."""

from __future__ import annotations

import dataclasses
import random
import threading
from pathlib import Path

import pytest
from durable_server import DurableServer
from harness import SCHEDULERS, check_manager, kv_cache_config, make_scheduler, run_workload, vllm_config
from kvcoord.client import KVCoordClient
from kvcoord.client import vllm as kvcoord_vllm
from kvcoord.client.faults import FaultInjector
from kvcoord.client.retry import DEFAULT_RETRY
from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler
from kvcoord.service.testing import InProcessServer
from test_scheduler_equivalence import first_difference

KVCOORD = {"sync": KVCoordScheduler, "async": KVCoordAsyncScheduler}


@pytest.mark.parametrize("predict", [False, True], ids=["exclusive", "predicted"])
@pytest.mark.parametrize("when", ["between steps", "during a step"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_decisions_survive_server_sigkills(
    kind: str, when: str, predict: bool, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The server is killed with SIGKILL and restarted on its journal three times in a
    300-step run under memory pressure, between two steps or 0-5 ms into one (a Step
    in flight, answered or not): every decision, output and event equals vLLM's own
    manager's, as if nothing had happened; also with KVCOORD_PREDICT=1, whose Steps are
    in flight while the engine runs on."""
    caplog.set_level("WARNING", logger="kvcoord.client")
    asynchronous = kind == "async"
    local = make_scheduler(
        SCHEDULERS[kind],
        vllm_config(model_dir, 64, async_scheduling=asynchronous),
        kv_cache_config("full", 64),
    )
    want, want_counts = run_workload(local, seed=11, steps=300, async_overlap=asynchronous)
    server = DurableServer(tmp_path)
    server.start()
    try:
        monkeypatch.setenv("KVCOORD_TARGET", server.address)
        monkeypatch.setenv("KVCOORD_POOL", f"restarts-{kind}")
        monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
        remote = make_scheduler(
            KVCOORD[kind],
            vllm_config(model_dir, 64, async_scheduling=asynchronous),
            kv_cache_config("full", 64),
        )

        rnd = random.Random(7)
        killers: list[threading.Thread] = []

        def restart(delay: float) -> None:
            threading.Event().wait(delay)
            server.kill()
            server.start()

        def on_step(step: int) -> None:
            if step not in (60, 150, 240):
                return
            if when == "between steps":
                restart(0)
            else:  # the step goes on while the server dies
                killers.append(threading.Thread(target=restart, args=(rnd.uniform(0, 0.005),)))
                killers[-1].start()

        got, got_counts = run_workload(
            remote, seed=11, steps=300, async_overlap=asynchronous, on_step=on_step
        )
        manager = remote.kv_cache_manager.remote
        remote.shutdown()
    finally:
        for t in killers:
            t.join(timeout=120)
        server.stop()
    assert got == want, first_difference(want, got)
    assert got_counts == want_counts and want_counts["preempted"] > 0
    assert server.kills == 3
    check_manager(manager, predict, caplog.records)  # (a server process may read edited engine sources)
    assert manager.lost_requests == 0


@pytest.mark.parametrize(
    ("layout", "predict"),
    [("full", False), ("full+swa", False), ("full", True)],
    ids=["full", "full+swa", "full-predicted"],
)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_decisions_survive_a_faulty_network(
    kind: str, layout: str, predict: bool, model_dir: Path, server: InProcessServer,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """5 % of the manager's calls each have their answer dropped, delayed, duplicated
    or re-delivered later (a client interceptor; 20 % each with KVCOORD_PREDICT=1,
    which makes few calls): retries with idempotency keys and position checks keep
    every decision, output and event equal to vLLM's own manager's, and no request is
    lost."""
    caplog.set_level("WARNING", logger="kvcoord.client")
    asynchronous = kind == "async"
    local = make_scheduler(
        SCHEDULERS[kind],
        vllm_config(model_dir, 64, async_scheduling=asynchronous),
        kv_cache_config(layout, 64),
    )
    want, want_counts = run_workload(local, seed=31, steps=300, async_overlap=asynchronous)
    # KVCOORD_PREDICT=1 makes about 40 calls in the run (one Step per few steps): more faults each
    rate = 0.2 if predict else 0.05
    faults = FaultInjector(5, drop=rate, delay=rate, duplicate=rate, reorder=rate)
    # Every injected fault ends after the server answered (the interceptor waits for
    # it), and without KVCOORD_PREDICT each call blocks the engine: how long a retry
    # pauses changes no order of events, only the wall time (DEFAULT_RETRY's first
    # pauses, ~25 ms each, ~480 of them, were 13 s of a 22 s run). Same attempts and
    # deadlines. Predicted runs keep DEFAULT_RETRY: their Steps overlap the engine.
    retry = DEFAULT_RETRY if predict else dataclasses.replace(DEFAULT_RETRY, initial_backoff=0.002)

    def faulty_client(target: str, **kw: object) -> KVCoordClient:
        return KVCoordClient(target, interceptors=[faults], retry=retry, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kvcoord_vllm, "KVCoordClient", faulty_client)
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"faulty-{kind}-{layout.replace('+', '-')}-{int(predict)}")
    monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    remote = make_scheduler(
        KVCOORD[kind], vllm_config(model_dir, 64, async_scheduling=asynchronous), kv_cache_config(layout, 64)
    )
    got, got_counts = run_workload(remote, seed=31, steps=300, async_overlap=asynchronous)
    manager = remote.kv_cache_manager.remote
    remote.shutdown()
    assert got == want, first_difference(want, got)
    assert got_counts == want_counts and want_counts["preempted"] > 0
    c = faults.counts
    assert min(c["dropped"], c["delayed"], c["duplicated"], c["reordered"]) > (2 if predict else 5), c
    assert manager.lost_requests == 0
    check_manager(manager, predict, caplog.records)
