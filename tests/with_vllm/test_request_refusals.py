"""A refusal about a request, met by vLLM's scheduler on kvcoord, is neither a pool gone
from the server nor an outage: it reaches vLLM at once, as ``RequestUnknownError``.

REQUEST_UNKNOWN says the pool does not hold a request the client believes it holds. It
never passes with time: the server checks a call's fence and session before its
requests (a restart, a lease that ran out, a pool re-created or handed over answer with
their own reasons first), and the requests of a live session leave its table only by
the session's own calls; a predicted session's mirror is the client's own engine,
changed only by the client's calls. Waiting for it as for an outage made the scheduler
undo and make the call again, pausing between attempts, for up to
``KVCOORD_MAX_OUTAGE`` seconds (600 by default) before the error reached vLLM.

Before that, the mirror refused such a request with a plain ``NotFoundError``, which the
scheduler read as "the pool is gone" and created the pool again, at once, until
``KVCOORD_MAX_OUTAGE``; that stays tested here (no ``create_pool_again``).

What does pass is a loss: in the waiting mode, a request whose sync the server refuses
is forgotten, freed there and reported lost (``RequestsLostError``), and the scheduler
preempts and recomputes it at once, with no pause (a loss, counted towards
``MAX_LOSSES_IN_A_ROW``, not an outage)."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import kv_cache_config, make_scheduler, run_workload, vllm_config
from kvcoord.client import RequestsLostError, RequestUnknownError
from kvcoord.service.testing import InProcessServer


def _scheduler(
    server: InProcessServer, model_dir: Path, monkeypatch: pytest.MonkeyPatch, pool: str, predict: str
) -> tuple[Any, list[int], list[str]]:
    """vLLM's Scheduler on kvcoord (``KVCOORD_MAX_OUTAGE`` 600, the default), and what
    it does while it waits: the pool created again (once per call), and the error each
    pause between attempts waited for (a pause runs inside the scheduler's handler of
    that error)."""
    from kvcoord.client import vllm_scheduler

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", pool)
    monkeypatch.setenv("KVCOORD_PREDICT", predict)
    monkeypatch.setenv("KVCOORD_MAX_OUTAGE", "600")
    waited: list[str] = []

    def pause(seconds: float) -> None:
        err = sys.exc_info()[1]
        cause = err.cause if isinstance(err, RequestsLostError) else err
        waited.append(type(cause).__name__)
        time.sleep(seconds)
        if len(waited) > 8:  # (bounded: the run fails instead of waiting 600 s)
            raise AssertionError(f"still waiting after 8 pauses: {waited}")

    monkeypatch.setattr(vllm_scheduler, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=pause))
    scheduler = make_scheduler(
        vllm_scheduler.KVCoordScheduler,
        vllm_config(model_dir, 64, async_scheduling=False),
        kv_cache_config("full", 64),
    )
    created: list[int] = []
    monkeypatch.setattr(
        scheduler.kv_cache_manager, "create_pool_again", lambda: bool(created.append(1)) or True
    )
    return scheduler, created, waited


def _run(scheduler: Any, on_step: Callable[[int], None]) -> None:
    try:
        run_workload(scheduler, seed=3, steps=40, async_overlap=False, aborts=False, on_step=on_step)
    finally:
        scheduler.shutdown()


def test_a_request_the_mirror_does_not_hold_reaches_vllm_at_once(
    model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror forgets a running request behind the scheduler's back (as a bug would):
    the next schedule() raises RequestUnknownError, naming it, without waiting (before:
    it undid the call, paused as for an outage and made it again), and never asks for
    the pool to be created again."""
    scheduler, created, waited = _scheduler(server, model_dir, monkeypatch, "refused-request", "1")
    adapter = scheduler.kv_cache_manager
    forgotten: list[str] = []

    def on_step(step: int) -> None:
        if step == 10 and not forgotten:
            engine = adapter.remote.mirror.engine
            rid = next(r.request_id for r in scheduler.running if r.request_id in engine.requests)
            engine.free(rid)
            forgotten.append(rid)

    raised: RequestUnknownError | None = None
    try:
        _run(scheduler, on_step)
    except RequestUnknownError as err:
        raised = err
    assert "RequestUnknownError" not in waited, f"a request's refusal was waited for as an outage: {waited}"
    assert created == [], f"the pool was created again {len(created)} times for a request's refusal"
    assert forgotten and raised is not None and repr(forgotten[0]) in str(raised), (forgotten, raised)


def test_a_refusal_that_recurs_is_not_waited_for(
    model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror refuses one request's every allocation from step 10 on (as a bug
    would): nothing the scheduler does changes it, and the error reaches vLLM at once
    (before: it was undone, paused for and made again until KVCOORD_MAX_OUTAGE, ten
    minutes by default)."""
    from kvcoord.client.mirror import engine_error
    from kvcoord.engine import RequestNotFoundError

    scheduler, created, waited = _scheduler(server, model_dir, monkeypatch, "refused-always", "1")
    mirror = scheduler.kv_cache_manager.remote.mirror
    refused: list[str] = []

    def refusing(call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(rid: str, *args: Any) -> Any:
            if rid in refused:
                raise engine_error(RequestNotFoundError(f"request {rid!r} is not in this pool"))
            return call(rid, *args)

        return wrapped

    for name in ("allocate", "grow", "decode_token", "decode_step"):
        monkeypatch.setattr(mirror, name, refusing(getattr(mirror, name)))

    def on_step(step: int) -> None:
        if step == 10 and not refused:
            refused.append(scheduler.running[0].request_id)

    with pytest.raises(RequestUnknownError):
        _run(scheduler, on_step)
    assert refused
    assert "RequestUnknownError" not in waited, f"a request's refusal was waited for as an outage: {waited}"
    assert created == []


def test_requests_the_server_no_longer_holds_are_recomputed(
    model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiting mode (KVCOORD_PREDICT=0): the server drops every running request behind
    the client's back. Each one's next sync is refused REQUEST_UNKNOWN; the manager
    reports it lost, the scheduler preempts it and makes the call again at once, with no
    pause (before: the second such loss in a schedule() call, and every one after it, was
    waited for as an outage), and it is recomputed: the run completes."""
    scheduler, created, waited = _scheduler(server, model_dir, monkeypatch, "dropped-requests", "0")
    dropped: list[str] = []

    def drop() -> list[str]:
        pool = server.running.servicer.registry.pools["dropped-requests"]  # type: ignore[union-attr]
        rids = [r.request_id for r in scheduler.running if r.request_id in pool.engine.requests]
        for rid in rids:
            pool.engine.free(rid)
            pool.owners.pop(rid).owned.pop(rid, None)
        return rids

    def on_step(step: int) -> None:
        if step == 10 and not dropped:
            dropped.extend(server.call(drop))

    _run(scheduler, on_step)
    assert len(dropped) >= 2 and scheduler.kvcoord_preempted >= len(dropped), (
        dropped,
        scheduler.kvcoord_preempted,
    )
    assert "RequestUnknownError" not in waited, f"a request's refusal was waited for as an outage: {waited}"
    assert created == []
