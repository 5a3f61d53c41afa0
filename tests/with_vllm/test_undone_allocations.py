"""An outage that cuts short a schedule() call after an allocation the server applied.

vLLM caches, at allocation, the hashes of the full blocks the step is about to compute
(``allocate_slots`` caches up to the computed tokens plus the new ones). The plug-in
undoes a call an outage cut short (``UndoCutShort._undo``): the waiting requests it
admitted are freed and waiting again, the running requests it allocated for are
preempted. After an outage the client cannot know whether the server applied the
allocation (its answer was lost), so it cannot name the blocks; the frees of the undo
carry ``FreeOp.uncomputed_from`` (the tokens whose KV existed before the call), and the
pool drops the cache entries of the request's blocks past them. Before, those frees left
the hashes on blocks whose KV the model never wrote: the call made again (or another
request) hit them, and the model read garbage as a prefix (silent wrong KV: the model
stand-in's tokens do not depend on the KV, so :class:`kv_oracle.KVOracle` checks it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import BLOCK_SIZE, SCHEDULERS, check_manager, kv_cache_config, make_scheduler, vllm_config
from kv_oracle import KVOracle
from kvcoord.client.errors import UnavailableError
from kvcoord.service.testing import InProcessServer
from test_lost_transfers import _guarded_run
from vllm.v1.request import RequestStatus

CUTS = 3
#: the allocations whose answer is lost: for a waiting request (admitted by the call:
#: freed by the undo), or for a running one (preempted by it)
STATUS = {"admitted": RequestStatus.WAITING, "running": RequestStatus.RUNNING}


def _config(model_dir: Path, kind: str) -> Any:
    """test_lost_transfers' configuration (its connector's loads and sends) with a
    token budget of 64 a step: prefills come in chunks (a running request's next chunk
    caches the full blocks it is to compute, under the asynchronous scheduler too)."""
    return vllm_config(
        model_dir, 64, async_scheduling=kind == "async", connector="SlowTransfersConnector",
        max_num_batched_tokens=64,
    )  # fmt: skip


def _caches_a_block(request: Any, num_new_tokens: int) -> bool:
    """The allocation caches a full block (vLLM caches up to the computed tokens plus
    the new ones, at most the request's tokens) that the step is to complete."""
    computed = int(request.num_computed_tokens)
    return min(computed + num_new_tokens, request.num_tokens) // BLOCK_SIZE > computed // BLOCK_SIZE


@pytest.mark.parametrize("whose", list(STATUS))
@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_outage_after_an_applied_allocation_leaves_no_hash_of_uncomputed_blocks(
    kind: str, predict: bool, whose: str, model_dir: Path, server: InProcessServer,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Three times in the run (ten steps apart at least), an allocation for a waiting
    request (of 32 tokens or more) or a running one (a prefill's next chunk or a decode
    step that completes a block) is applied (the server's pool, or the predicted
    session's mirror and its next Step, cached the hashes of the full blocks the step
    was to compute) and then its answer is lost: the manager's call raises
    UnavailableError. The call is undone and made again. Every scheduled request's
    blocks hold the KV of its own prefix below its computed tokens (:class:`KVOracle`),
    and every request completes with the tokens of vLLM's own run. (Before, the undone
    request, looked up again, hit the blocks the cut allocation had cached, and counted
    as computed the positions nothing had written.)"""
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    caplog.set_level("WARNING", logger="kvcoord.client")
    want, _ = _guarded_run(
        make_scheduler(SCHEDULERS[kind], _config(model_dir, kind), kv_cache_config("full", 64))
    )
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"undone-allocation-{kind}-{int(predict)}-{whose}")
    monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    cls = KVCoordAsyncScheduler if kind == "async" else KVCoordScheduler
    scheduler = make_scheduler(cls, _config(model_dir, kind), kv_cache_config("full", 64))
    oracle = KVOracle(scheduler)
    adapter = scheduler.kv_cache_manager
    allocate = adapter.allocate_slots
    state = {"step": 0, "last": -10, "undone": 0}
    cuts: list[tuple[int, str]] = []  # (step, request)
    undone: list[bool] = []  # per cut: the call it was met in was undone

    def answer_lost(req: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        got = allocate(req, num_new_tokens, *args, **kwargs)
        if (
            got is None
            or req.status != STATUS[whose]
            or num_new_tokens < (32 if whose == "admitted" else 1)
            or not _caches_a_block(req, num_new_tokens)
            or len(cuts) >= CUTS
            or state["step"] < state["last"] + 10
        ):
            return got
        cuts.append((state["step"], req.request_id))
        state["last"], state["undone"] = state["step"], scheduler.kvcoord_undone
        raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "injected: the answer was lost")

    adapter.allocate_slots = answer_lost  # (after the call: the pool and the adapter applied it)

    def on_step(step: int) -> None:
        if len(undone) < len(cuts):
            undone.append(scheduler.kvcoord_undone > state["undone"])
        state["step"] = step

    got, _ = _guarded_run(scheduler, on_step)
    check_manager(adapter.remote, predict, caplog.records)
    assert len(cuts) == CUTS and undone == [True] * CUTS, (cuts, undone)
    oracle.assert_clean()
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
