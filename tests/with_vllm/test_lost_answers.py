"""vLLM's Scheduler and AsyncScheduler in the waiting mode (KVCOORD_PREDICT=0), on a
shared pool (KVCOORD_EXCLUSIVE=0) and an exclusive one, under the KV-content oracle
(kv_oracle.py), while Steps fail without the session ending: right after a prefill's
allocation, two Steps are applied with their answers lost past every retry (their
requests lost: OutcomeUnknownError) and the next four never reach the server (an
outage, which cuts a schedule() call short and undoes it).

Both kinds of free these faults cause drop cache entries: a lost Step's requests are
freed with ``FreeOp.uncomputed_from`` (their allocation cached blocks nobody computes),
and so is an undone call's request. When the Step carrying such a free fails too, the
free is sent again keeping it. (Before, a free sent again was a plain Free: the pool
kept the hashes of blocks nobody wrote, and the same engine, or any engine sharing the
pool, read them as a prefix hit: ``(17, 'never written', 'r13', 0, 96, 58)`` on 0.16.)
Every scheduled request must read its own KV, and every request completes with vLLM's
own tokens."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import SCHEDULERS, kv_cache_config, make_scheduler, run_workload, vllm_config
from kv_oracle import KVOracle
from kvcoord.client import KVCoordClient
from kvcoord.client import vllm as kvcoord_vllm
from kvcoord.client.faults import FaultInjector
from kvcoord.client.retry import RetryPolicy
from kvcoord.service.testing import InProcessServer
from test_lost_sessions import outputs_by_request

STEPS = 70
FAULTS = 4  # at most, each at least 10 steps after the last
SCRIPT = "drop2cut4"  # per Step: 2 applied with their answers lost, then 4 never sent
BLOCKS = 64
METHODS = (
    "get_computed_blocks", "allocate_slots", "free", "cache_blocks", "get_block_ids", "get_blocks",
    "get_num_common_prefix_blocks", "take_events", "make_prefix_cache_stats", "remove_skipped_blocks",
    "evict_blocks", "reset_prefix_cache",
)  # fmt: skip


class Scripted(FaultInjector):
    """Each Step (a StepStream message) takes the next fault of ``script`` ("drop":
    applied, its answer lost; "cut": never sent), none once it is empty: the same faults
    at the same Steps every run, unlike drawn ones; every Step "cut" while partitioned."""

    def __init__(self) -> None:
        super().__init__(0, methods=("Step",))
        self.script: list[str] = []

    def draw_message(self, request: Any) -> tuple[str, Any]:
        if self.partitioned:
            return "cut", None
        with self._lock:
            if not self.script:
                return "none", None
            self.counts["calls"] += 1
            return self.script.pop(0), None


@pytest.fixture
def fresh_server() -> Iterator[InProcessServer]:
    srv = InProcessServer().start()
    yield srv
    srv.stop()


def _run(s: Any, on_step: Any = None) -> dict[str, Any]:
    try:
        trace, _ = run_workload(
            s, seed=11, steps=STEPS, async_overlap=s.scheduler_config.async_scheduling, aborts=False,
            drain=True, positional=True, on_step=on_step,
        )  # fmt: skip
    finally:
        s.shutdown()
    return outputs_by_request(trace)


def _config(model_dir: Path, kind: str) -> Any:
    return vllm_config(model_dir, BLOCKS, async_scheduling=kind == "async")


_WANT: dict[tuple[str, str], dict[str, Any]] = {}


def _want(model_dir: Path, kind: str, layout: str) -> dict[str, Any]:
    """vLLM's own manager's outputs (its run clean under the oracle too)."""
    if (kind, layout) not in _WANT:
        s = make_scheduler(SCHEDULERS[kind], _config(model_dir, kind), kv_cache_config(layout, BLOCKS))
        oracle = KVOracle(s)
        _WANT[kind, layout] = _run(s)
        oracle.assert_clean()
    return _WANT[kind, layout]


def lose_after_prefill(
    adapter: Any, methods: tuple[str, ...], state: dict[str, Any], start: Any, *, at_the_allocation: bool = False,
) -> None:  # fmt: skip
    """Wrap ``adapter``'s ``methods``: while ``state["armed"]``, the first manager call
    after a prefill's allocation (``allocate_slots`` of 32 or more new tokens that took
    blocks) calls ``start()`` (which scripts the losses) before it runs, disarms and
    records ``(state["step"], method)`` in ``state["met"]``. ``at_the_allocation``: the
    prefill's own allocation is that call (its Step is the first lost)."""

    def wrap(name: str) -> None:
        orig = getattr(adapter, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            prefill = name == "allocate_slots" and len(args) > 1 and args[1] >= 32
            if at_the_allocation and state["armed"] and prefill:
                state["prefilled"] = True
            if state["armed"] and state["prefilled"]:  # the manager call after a prefill's allocation
                state["armed"] = state["prefilled"] = False
                state["met"].append((state["step"], name))
                start()
            got = orig(*args, **kwargs)
            if state["armed"] and prefill and got is not None:
                state["prefilled"] = True
            return got

        setattr(adapter, name, wrapped)

    for name in methods:
        if hasattr(adapter, name):
            wrap(name)


@pytest.mark.parametrize("layout", ["full", "full+swa"])
@pytest.mark.parametrize("exclusive", [False, True], ids=["shared", "exclusive"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_steps_lost_and_cut_leave_no_hash_of_kv_nobody_wrote(
    kind: str, exclusive: bool, layout: str, model_dir: Path, fresh_server: InProcessServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    want = _want(model_dir, kind, layout)
    scripted = Scripted()
    retry = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)  # answers lost past it

    def faulty_client(target: str, **kw: Any) -> KVCoordClient:
        return KVCoordClient(target, interceptors=[scripted], retry=retry, **kw)

    monkeypatch.setattr(kvcoord_vllm, "KVCoordClient", faulty_client)
    monkeypatch.setenv("KVCOORD_TARGET", fresh_server.address)
    monkeypatch.setenv("KVCOORD_POOL", "lost-answers")
    monkeypatch.setenv("KVCOORD_PREDICT", "0")
    monkeypatch.setenv("KVCOORD_EXCLUSIVE", "1" if exclusive else "0")
    monkeypatch.setenv("KVCOORD_MAX_OUTAGE", "20")
    cls = KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler
    s = make_scheduler(cls, _config(model_dir, kind), kv_cache_config(layout, BLOCKS))
    oracle = KVOracle(s)
    adapter = s.kv_cache_manager
    state: dict[str, Any] = {"armed": False, "prefilled": False, "met": [], "step": -1}
    script = [kind for kind, n in re.findall(r"(drop|cut)(\d+)", SCRIPT) for _ in range(int(n))]

    def start_loss() -> None:
        scripted.script = list(script)

    lose_after_prefill(adapter, METHODS, state, start_loss)

    def on_step(step: int) -> None:
        state["step"], state["prefilled"] = step, False
        met = state["met"]
        if step >= 15 and len(met) < FAULTS and not state["armed"] and (not met or step >= met[-1][0] + 10):
            state["armed"] = True

    got = _run(s, on_step)
    assert state["met"], "no fault was injected"
    assert scripted.counts["dropped"] >= 1  # answers were lost (not only Steps cut)
    assert s.kvcoord_undone + s.kvcoord_preempted  # the faults cost calls and requests
    oracle.assert_clean()
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:3]]
