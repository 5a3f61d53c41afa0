"""An outage that cuts short the schedule() call that promoted a finished asynchronous
KV load (a loss met there already made the request compute its tokens again).

vLLM promotes a request whose load the connector reported finished inside schedule()
(``_update_waiting_for_remote_kv``: its loaded blocks cached, its computed tokens the
loaded ones, the connector's report forgotten, WAITING again) and then allocates for
it. A call cut short after that allocation is undone: the request's blocks are freed
(the server may have allocated for it). The tokens it counted as computed lived in
those blocks, so it must not keep them: a request that next allocates fresh blocks
while counting the loaded prefix as computed runs the model after a prefix whose KV
is not there (silent wrong KV; its tokens would differ only on a real model).

kv_oracle.KVOracle is the oracle: what each block slot holds KV for, written when
the model stand-in computes positions into a request's blocks (as the worker sees
them: the scheduler's outputs) and when a load lands in them, and checked every time
a request is scheduled: its blocks hold its own tokens at every position below its
computed tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import SCHEDULERS, check_manager, kv_cache_config, make_scheduler
from kv_oracle import KVOracle
from kvcoord.client.errors import UnavailableError
from kvcoord.service.testing import InProcessServer
from test_lost_transfers import _config, _guarded_run
from vllm.v1.request import RequestStatus


@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_outage_after_a_promoted_load_leaves_no_computed_tokens_without_their_blocks(
    kind: str, predict: bool, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Three times in the run, right after schedule() promoted a request whose load the
    connector reported finished (its loaded blocks cached, its computed tokens the
    loaded ones, the report forgotten), the allocation for it fails: the server cannot
    be reached (the manager's call raises UnavailableError; nothing reaches the
    server). The call is undone and made again. Every scheduled request's blocks hold
    its own tokens below its computed tokens (KVOracle), no block a transfer
    uses is given to another request, and every request completes with the tokens of
    vLLM's own run. (Before, the undone request was WAITING with its loaded tokens
    computed but its blocks freed: the next call allocated it fresh blocks, the model
    ran after a prefix whose KV was not in them, and other requests then hit those
    blocks in the prefix cache. The tokens alone did not show it: the model stand-in's
    tokens do not depend on the KV.) A loss met there instead already made the request
    compute its tokens again (see _lost_during_transfers)."""
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    caplog.set_level("WARNING", logger="kvcoord.client")
    want, _ = _guarded_run(
        make_scheduler(SCHEDULERS[kind], _config(model_dir, kind), kv_cache_config("full", 64))
    )
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"lost-promotion-{kind}-{int(predict)}")
    monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    cls = KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler
    scheduler = make_scheduler(cls, _config(model_dir, kind), kv_cache_config("full", 64))
    kv = KVOracle(scheduler)
    adapter = scheduler.kv_cache_manager
    state = {"step": 0, "last": 0, "undone": 0}
    cuts: list[tuple[int, str, int]] = []  # (step, request, its computed tokens when promoted)
    failed: list[str] = []  # the allocations made to fail
    undone: list[bool] = []  # per cut: the call it was met in was undone
    cache_blocks = adapter.cache_blocks

    def cut_after_promotion(request: Any, num_computed_tokens: int) -> None:
        cache_blocks(request, num_computed_tokens)
        rid = request.request_id
        promoting = (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and rid in scheduler.finished_recving_kv_req_ids
            and rid not in scheduler.failed_recving_kv_req_ids
        )
        if not promoting or len(cuts) >= 3 or state["step"] < state["last"] + 10:
            return
        cuts.append((state["step"], rid, num_computed_tokens))
        state["last"], state["undone"] = state["step"], scheduler.kvcoord_undone
        remote = adapter.remote
        allocate = remote.allocate_slots

        def unreachable(req: Any, *args: Any, **kwargs: Any) -> Any:
            if req.request_id != rid:
                return allocate(req, *args, **kwargs)
            del remote.allocate_slots  # (once)
            failed.append(rid)
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "injected: the server cannot be reached")

        remote.allocate_slots = unreachable

    adapter.cache_blocks = cut_after_promotion

    def on_step(step: int) -> None:
        if len(undone) < len(cuts):
            undone.append(scheduler.kvcoord_undone > state["undone"])
        state["step"] = step

    got, guard = _guarded_run(scheduler, on_step)
    check_manager(
        adapter.remote, predict, caplog.records
    )  # (a server process may read edited engine sources)
    assert len(cuts) == 3 and [rid for _, rid, _ in cuts] == failed and undone == [True] * 3, (
        cuts,
        failed,
        undone,
    )
    assert not kv.violations, (
        f"requests scheduled on blocks without their KV: {kv.violations[:5]}; cut after promoting "
        f"(step, request, computed): {cuts}"
    )
    kv.assert_clean()
    assert not guard.overlaps, (
        f"blocks in transfer given to other requests (request, block, transfer's): {guard.overlaps[:5]}"
    )
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
