"""vLLM 0.33.0's schedulers on kvcoord when the predicted session is lost between steps:
the engine preempts the requests lost and recomputes them, and every request completes
with the tokens of vLLM's own run (0.16.0's are in test_lost_sessions.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from harness import (
    SCHEDULERS,
    V033,
    check_manager,
    kv_cache_config,
    make_scheduler,
    run_workload,
    vllm_config,
)
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from test_lost_sessions import outputs_by_request

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (this venv has another release)")

STEPS = 120
#: the step before which the session is ended
LOSS_STEP = 40


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_session_ended_between_steps_costs_recomputation(
    kind: str, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before step 40 the server ends the engine's session (another client detaches it,
    as a lease running out would): the Step the manager sends in the background fails,
    the next schedule() preempts every running request (all lost) and recomputes them.
    (Before, RequestsLostError left schedule() and vLLM 0.33's engine core died.)"""
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    asynchronous = kind == "async"
    local = make_scheduler(SCHEDULERS[kind], vllm_config(model_dir, 64, async_scheduling=asynchronous),
                           kv_cache_config("full", 64))  # fmt: skip
    trace, _ = run_workload(local, seed=5, steps=STEPS, async_overlap=asynchronous, aborts=False, drain=True,
                            positional=True)  # fmt: skip
    want = outputs_by_request(trace)
    assert want and all(reason == "length" for _, reason in want.values())

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"lost033-{kind}")
    monkeypatch.setenv("KVCOORD_PREDICT", "1")
    cls = KVCoordAsyncScheduler if asynchronous else KVCoordScheduler
    remote = make_scheduler(cls, vllm_config(model_dir, 64, async_scheduling=asynchronous),
                            kv_cache_config("full", 64))  # fmt: skip
    manager = remote.kv_cache_manager.remote
    ended: list[str] = []

    def on_step(step: int) -> None:
        if step == LOSS_STEP:
            manager.flush()  # nothing in flight: the next Step is the first to fail
            with KVCoordClient(server.address) as other:
                other.detach(manager.session_id)
            ended.append(manager.session_id)
        elif step == LOSS_STEP + 1:
            # the Step sent while applying step 40's outputs fails in the background:
            # wait (bounded, on a hang only: a loaded machine runs the sender thread late)
            # until the manager knows, so the loss is met between steps
            deadline = time.monotonic() + 120.0
            while manager.sender.failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert manager.sender.failure is not None

    try:
        trace, _ = run_workload(remote, seed=5, steps=STEPS, async_overlap=asynchronous, aborts=False,
                                drain=True, positional=True, on_step=on_step)  # fmt: skip
    finally:
        remote.shutdown()
    got = outputs_by_request(trace)
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
    assert ended and manager.session_id != ended[0]  # a new session
    assert manager.lost_requests > 0  # requests were lost
    assert remote.kvcoord_preempted > 0  # and preempted for recomputation


@pytest.mark.parametrize("event", ["inside a step", "partition", "emptied", "sigkill"])
@pytest.mark.parametrize("layout", ["full+swa", "full+mamba-align", "full+mamba"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_hybrid_and_mamba_layouts_recover_like_full_attention(
    kind: str, layout: str, event: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """vLLM 0.33's schedulers, predicted, on a full + sliding-window pool and on full +
    mamba pools (state cached at block boundaries, or not at all): the session ended on
    the server inside schedule() (before its second allocation) at steps 40 and 80; or a
    partition of 3 x the lease from step 80; or the server SIGKILLed at step 80 and
    started with its data directory deleted; or SIGKILLed and restarted on its journal
    at steps 40 and 80. Every request completes with vLLM's own tokens; a loss costs
    recomputation, a restart on the journal costs nothing. (Before, the loss or the
    outage left schedule() and vLLM 0.33's engine core died.)"""
    import shutil
    import threading

    from durable_server import DurableServer
    from kvcoord.client import vllm as kvcoord_vllm
    from kvcoord.client.faults import FaultInjector
    from test_lost_sessions import LEASE, LEASE_TOML, _run_on_kvcoord, _vllms_own

    caplog.set_level("WARNING", logger="kvcoord.client")
    want = _vllms_own(kind, model_dir, layout=layout)
    lease = LEASE_TOML if event == "partition" else ""
    server = DurableServer(tmp_path, pools_toml=lease)
    server.start()
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"l033-{kind}-{layout.replace('+', '-')}-{event.replace(' ', '-')}")
    monkeypatch.setenv("KVCOORD_PREDICT", "1")
    faults = FaultInjector(0)
    timer = threading.Timer(3 * LEASE, lambda: setattr(faults, "partitioned", False))
    if event == "partition":

        def faulty_client(target: str, **kw: object) -> KVCoordClient:
            return KVCoordClient(target, interceptors=[faults], **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(kvcoord_vllm, "KVCoordClient", faulty_client)
    armed = {"on": False, "allocations": 0, "ended": 0}
    remote: Any = None

    def wrap(scheduler: Any) -> None:
        nonlocal remote
        remote = scheduler
        adapter = scheduler.kv_cache_manager
        allocate = adapter.allocate_slots

        def allocate_slots(*args: Any, **kwargs: Any) -> Any:
            if armed["on"]:
                armed["allocations"] += 1
                if armed["allocations"] == 2:
                    manager = adapter.remote
                    manager.client.detach(manager.session_id, manager.keeper.fence)
                    armed["on"] = False
                    armed["ended"] += 1
            return allocate(*args, **kwargs)

        adapter.allocate_slots = allocate_slots

    def on_step(step: int) -> None:
        if step not in (40, 80):
            return
        if event == "inside a step":
            armed["on"], armed["allocations"] = True, 0
        elif event == "sigkill":
            server.kill()
            server.start()
        elif step == 80 and event == "emptied":
            server.kill()
            shutil.rmtree(server.data_dir)
            server.start()
        elif step == 80:
            faults.partitioned = True
            timer.start()

    try:
        got, scheduler = _run_on_kvcoord(kind, model_dir, on_step, wrap, layout=layout)
    finally:
        timer.cancel()
        server.stop()
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
    manager = scheduler.kv_cache_manager.remote
    check_manager(manager, True, caplog.records)  # (a server process may read edited engine sources)
    if event == "sigkill":
        assert server.kills == 2 and manager.lost_requests == 0
    else:
        assert manager.lost_requests > 0 and scheduler.kvcoord_preempted > 0
    if event == "inside a step":
        assert armed["ended"] == 2


@pytest.mark.parametrize("event", ["detach", "emptied"])
@pytest.mark.parametrize("predict", [False, True], ids=["remote", "predicted"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_session_ended_between_a_copy_and_its_release_costs_recomputation(
    kind: str, predict: bool, event: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fine-grained hits with copy-on-write (full attention + mamba "align" of 32-token
    blocks hashed every 16 tokens): right after the scheduler took copy pairs (twice in
    the run) the engine's session ends: another client detaches it, or the server is
    SIGKILLed and started with its data directory deleted (the plug-in creates the pool
    again). The scheduler frees those pairs' handles only once a new session began (as
    vLLM 0.33 defers them behind overlapping steps with a KV-consumer connector): the
    plug-in drops them, their retentions ended with the session. Every request completes
    with vLLM's own tokens, and once the engine shut down every block is free and the
    prefix cache can be reset. (Before, the detached session's blocks stayed retained,
    and a stale handle in a pool made again failed BLOCK_NOT_RETAINED: vLLM's engine
    core died.)"""
    import shutil

    from durable_server import DurableServer
    from kvcoord.client.vllm033_parts import RetainedBlock
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler
    from test_scheduler_equivalence import _partial_hits_kv_config

    asynchronous = kind == "async"

    def config() -> Any:
        cfg = vllm_config(model_dir, 200, async_scheduling=asynchronous, mamba_cache_mode="align")
        cfg.cache_config.block_size = 32
        cfg.cache_config.prefix_match_unit = 16
        return cfg

    local = make_scheduler(SCHEDULERS[kind], config(), _partial_hits_kv_config(200))
    trace, _ = run_workload(local, seed=3, steps=STEPS, async_overlap=asynchronous, aborts=False, drain=True,
                            positional=True)  # fmt: skip
    want = outputs_by_request(trace)
    assert want and all(reason == "length" for _, reason in want.values())

    server = DurableServer(tmp_path)
    server.start()
    pool = f"cowlost-{kind}-{int(predict)}-{event}"
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", pool)
    monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    cls = KVCoordAsyncScheduler if asynchronous else KVCoordScheduler
    remote = make_scheduler(cls, config(), _partial_hits_kv_config(200))
    adapter = remote.kv_cache_manager
    manager = adapter.remote
    take, free_blocks = adapter.take_kv_cache_block_copies, adapter.block_pool.free_blocks
    ended: list[str] = []
    taken = [0]
    late: list[Any] = []  # handles freed after a session ended, freed once a new one began
    stashing = [False]
    freed_late = [0]

    def take_then_end() -> Any:
        if stashing[0] and manager.session_id not in ended:
            stashing[0] = False
            free_blocks(list(late))
            freed_late[0] += len(late)
            late.clear()
        copies, retained = take()
        taken[0] += bool(copies)
        if copies and taken[0] in (3, 8):
            ended.append(manager.session_id)
            stashing[0] = True
            if event == "detach":
                with KVCoordClient(server.address) as other:
                    other.detach(manager.session_id)
            else:
                server.kill()
                shutil.rmtree(server.data_dir)
                server.start()
        return copies, retained

    def free_late(blocks: Any) -> None:
        blocks = list(blocks)
        stale = [b for b in blocks if stashing[0] and isinstance(b, RetainedBlock)]
        late.extend(stale)
        free_blocks([b for b in blocks if not any(b is x for x in stale)])

    adapter.take_kv_cache_block_copies = take_then_end
    adapter.block_pool.free_blocks = free_late
    try:
        try:
            trace, _ = run_workload(remote, seed=3, steps=STEPS, async_overlap=asynchronous, aborts=False,
                                    drain=True, positional=True)  # fmt: skip
        finally:
            remote.shutdown()
        got = outputs_by_request(trace)
        differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
        assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
        assert len(ended) == 2 and manager.session_id not in ended  # the sessions ended, new ones began
        assert freed_late[0] > 0 and not late  # stale handles were freed in a new session
        assert manager.lost_requests > 0
        with KVCoordClient(server.address) as c:
            assert c.get_stats(pool).num_free_blocks == 199  # every block but the null block
            assert list(c.check_pool(pool).violations) == []
            assert c.reset_prefix_cache(pool).result
    finally:
        server.stop()
