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

:class:`KVContents` is the oracle: what token prefix each block's slots hold KV for,
written when the model stand-in computes positions into a request's blocks (as the
worker sees them: the scheduler's outputs) and when a load lands in them, and checked
every time a request is scheduled: its blocks hold its own tokens at every position
below its computed tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import BLOCK_SIZE, SCHEDULERS, VOCAB, check_manager, kv_cache_config, make_scheduler
from kvcoord.client.errors import UnavailableError
from kvcoord.service.testing import InProcessServer
from test_lost_transfers import _config, _guarded_run
from vllm.v1.request import RequestStatus


def _ideal_tokens(request: Any) -> list[int]:
    """The request's every token, as the positional model stand-in samples them
    (``fake_runner_output(positional=True)``: output ``i`` of request ``rN`` is
    ``(N * 7919 + i * 31 + 7) % VOCAB``, no drafts), known before they are sampled: a
    position's KV depends on the tokens up to it, whenever it is computed."""
    n = int(request.request_id[1:])
    outputs = [(n * 7919 + i * 31 + 7) % VOCAB for i in range(request.max_tokens)]
    return list(request.prompt_token_ids) + outputs


class KVContents:
    """Per block id, the token prefix whose KV its slots hold (up to the last position
    written into it), from the worker's side: the tables the scheduler's outputs give,
    the positions each step computes, and the connector's loads (a synchronous load
    lands in the step that schedules it; an asynchronous one when the worker reports it
    received, into the blocks the connector was told of). A load copies whole blocks
    of the prompt the remote computed, as a P/D transfer does (vLLM 0.16 counts a
    finished load's whole blocks as computed). ``wrong`` names every scheduled request
    whose blocks do not hold its own tokens below its computed tokens."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.tables: dict[str, list[int]] = {}
        self.ideal: dict[str, list[int]] = {}
        self.wrong: list[tuple[int, str, int, int, int]] = []  # (step, request, position, block, computed)
        self.checked = self.loads_landed = 0
        self.step = -1
        self._local: dict[str, int] = {}  # the local hit the connector was last told of
        self._loads: dict[str, tuple[list[int], int, int]] = {}  # async: (table, first block, tokens known)
        self._sync: dict[str, int] = {}  # synchronous loads of the call: their external tokens
        self._named: set[str] = set()  # (each request named once)
        connector = scheduler.connector
        matched, after_alloc, output = (
            connector.get_num_new_matched_tokens, connector.update_state_after_alloc, connector.worker_output,
        )  # fmt: skip

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            self._local[request.request_id] = num_computed_tokens
            return matched(request, num_computed_tokens)

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            after_alloc(request, blocks, num_external_tokens)
            rid = request.request_id
            if rid in connector.loading:
                first = self._local.get(rid, 0) // BLOCK_SIZE
                self._loads[rid] = (list(blocks.get_block_ids()[0]), first, request.num_tokens)
            elif num_external_tokens:
                self._sync[rid] = num_external_tokens

        def worker_output() -> Any:
            out = output()
            for rid in (out.finished_recving or ()) if out is not None else ():
                load = self._loads.pop(rid, None)
                if load is not None:
                    table, first, known = load
                    tokens = self._tokens(rid)
                    for j in range(first, len(table)):
                        self.blocks[table[j]] = tuple(tokens[: min((j + 1) * BLOCK_SIZE, known)])
                    self.loads_landed += 1
            return out

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.update_state_after_alloc = update_state_after_alloc
        connector.worker_output = worker_output
        schedule = scheduler.schedule

        def checked_schedule() -> Any:
            self._sync.clear()
            out = schedule()
            self.step += 1
            self.scheduled(out)
            return out

        scheduler.schedule = checked_schedule

    def _tokens(self, rid: str) -> list[int]:
        tokens = self.ideal.get(rid)
        if tokens is None:
            tokens = self.ideal[rid] = _ideal_tokens(self.scheduler.requests[rid])
        return tokens

    def _write(self, table: list[int], tokens: list[int], start: int, end: int) -> None:
        """Positions ``start`` to ``end`` (exclusive) computed or loaded into ``table``."""
        for j in range(start // BLOCK_SIZE, -(-end // BLOCK_SIZE)):
            self.blocks[table[j]] = tuple(tokens[: min(end, (j + 1) * BLOCK_SIZE)])

    def scheduled(self, out: Any) -> None:
        tables = self.tables
        for new in out.scheduled_new_reqs:
            tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for rid, groups in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if groups is None:
                continue
            if rid in cached.resumed_req_ids:
                tables[rid] = list(groups[0])
            else:
                tables.setdefault(rid, []).extend(groups[0])
        for rid, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            computed = request.num_computed_tokens - n  # (advanced by the step just scheduled)
            table, tokens = tables[rid], self._tokens(rid)
            external = self._sync.pop(rid, 0)
            if external:  # a synchronous load lands before the step computes
                self._write(table, tokens, computed - external, computed)
            for j in range(-(-computed // BLOCK_SIZE)):
                need = min(computed, (j + 1) * BLOCK_SIZE)
                held = self.blocks.get(table[j]) if j < len(table) else None
                if held is None or len(held) < need or list(held[:need]) != tokens[:need]:
                    bad = j * BLOCK_SIZE
                    while held is not None and bad < min(need, len(held)) and held[bad] == tokens[bad]:
                        bad += 1
                    if rid not in self._named:
                        self._named.add(rid)
                        self.wrong.append((self.step, rid, bad, table[j] if j < len(table) else -1, computed))
                    break
            self.checked += 1
            self._write(table, tokens, computed, computed + n)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_oracle_finds_nothing_on_vllms_own_manager(kind: str, model_dir: Path) -> None:
    """vLLM's own manager on the workload: every scheduled request's blocks hold its
    own tokens (else the oracle is wrong), with loads promoted on the way."""
    scheduler = make_scheduler(SCHEDULERS[kind], _config(model_dir, kind), kv_cache_config("full", 64))
    kv = KVContents(scheduler)
    got, _ = _guarded_run(scheduler)
    assert kv.checked > 500 and kv.loads_landed > 5, (kv.checked, kv.loads_landed)
    assert not kv.wrong, kv.wrong[:5]
    assert got and all(reason == "length" for _, reason in got.values())


def test_the_oracle_sees_a_swap(model_dir: Path) -> None:
    """Two running requests' tables swapped once in the worker's view: named."""
    scheduler = make_scheduler(SCHEDULERS["sync"], _config(model_dir, "sync"), kv_cache_config("full", 64))
    kv = KVContents(scheduler)
    scheduled = kv.scheduled
    done: list[bool] = []

    def swapping(out: Any) -> None:
        scheduled(out)
        running = [rid for rid in kv.tables if rid in scheduler.requests and len(kv.tables[rid]) > 1]
        if kv.step >= 30 and not done and len(running) >= 2:
            a, b = running[:2]
            kv.tables[a], kv.tables[b] = kv.tables[b], kv.tables[a]
            done.append(True)

    kv.scheduled = swapping  # type: ignore[method-assign]
    _guarded_run(scheduler)
    assert done and kv.wrong


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
    its own tokens below its computed tokens (:class:`KVContents`), no block a transfer
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
    kv = KVContents(scheduler)
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
    assert not kv.wrong, (
        "requests scheduled on blocks without their KV (step, request, position, block, computed): "
        f"{kv.wrong[:5]}; cut after promoting (step, request, computed): {cuts}"
    )
    assert not guard.overlaps, (
        f"blocks in transfer given to other requests (request, block, transfer's): {guard.overlaps[:5]}"
    )
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
