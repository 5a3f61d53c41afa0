"""vLLM's schedulers (0.16.0 or 0.33.0, whichever this venv has), predicted, through a
rolling upgrade of kvcoord to another engine: the server is stopped and started again
on its journal with another rules fingerprint mid-run, and the engine's session is
later lost. The re-attach finds an engine the client cannot mirror: the engine goes on
in the waiting mode (a warning names why) instead of stopping, the requests lost are
preempted and recomputed, and every request completes with the tokens of vLLM's own
run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from harness import V033, check_manager, manager_class_name
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from test_lost_sessions import _env, _run_on_kvcoord, _vllms_own

#: the step at which the server is upgraded, and the one at which the session is lost
UPGRADE_STEP, LOSS_STEP = 50, 80
#: full attention, a hybrid, and under 0.33 mamba with fine-grained hits (copy-on-write
#: blocks retained across the switch)
LAYOUTS = ["full", "full+swa"] + (["full+mamba-align"] if V033 else [])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_rolling_upgrade_to_another_engine_goes_on_in_the_waiting_mode(
    kind: str,
    layout: str,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At step 50 the server is stopped cleanly and started again on the same journal
    and port with another engine (its rules fingerprint replaced in the restarted server,
    as another release's would differ): the session survives and stays predicted, every
    answer compared. At step 80 the server ends the session (as a lease running out in
    a longer gap would): the re-attach is refused a mirror, the adapter goes on in the
    waiting mode, the requests lost are preempted and recomputed. (Before,
    FailedPreconditionError left schedule() and the engine stopped.)"""
    import kvcoord.service.pool_service as pool_service

    want = _vllms_own(kind, model_dir, layout=layout)
    data = str(tmp_path / "data")
    servers = [InProcessServer(data_dir=data).start()]
    address = servers[0].address
    _env(monkeypatch, servers[0], f"upgrade-{kind}-{layout.replace('+', '-')}", True)
    scheduler: Any = None
    seen: dict[str, Any] = {}

    def keep(s: Any) -> None:
        nonlocal scheduler
        scheduler = s
        seen["predicted"] = s.kv_cache_manager.remote

    def on_step(step: int) -> None:
        adapter = scheduler.kv_cache_manager
        if step == UPGRADE_STEP:
            servers[-1].stop()
            monkeypatch.setattr(pool_service, "rules_fingerprint", lambda: "state9-another-release")
            servers.append(InProcessServer(data_dir=data, port=int(address.rsplit(":", 1)[1])).start())
            assert servers[-1].address == address
        elif step == LOSS_STEP:
            assert (
                adapter.remote is seen["predicted"] and adapter.remote.lost_requests == 0
            )  # survived the restart
            with KVCoordClient(address) as other:
                other.detach(adapter.remote.session_id)

    try:
        with caplog.at_level("WARNING", logger="kvcoord.client"):
            got, scheduler = _run_on_kvcoord(kind, model_dir, on_step, keep, layout=layout)
    finally:
        servers[-1].stop()
    differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
    assert not differ, [(rid, want.get(rid), got.get(rid)) for rid in differ[:5]]
    adapter = scheduler.kv_cache_manager
    assert type(seen["predicted"]).__name__ == manager_class_name(True)
    assert type(adapter.remote).__name__ == manager_class_name(False) and not adapter.remote.exclusive
    assert adapter.unpredicted is not None and "state9-another-release" in adapter.unpredicted
    assert "can no longer be predicted" in caplog.text and "state9-another-release" in caplog.text
    lost = seen["predicted"].lost_requests
    assert lost > 0 and adapter.remote.lost_requests == lost  # the loss happened; the engine's count goes on
    assert scheduler.kvcoord_preempted > 0  # and preempted for recomputation


def test_a_predicted_engine_may_wait_only_after_the_fingerprint_warning() -> None:
    """check_manager (the tests' "must be predicted" check) accepts a predicted engine
    in the waiting mode only beside the plug-in's warning that the server's engine has
    other rules; the waiting kind where prediction was not asked for; nothing else."""
    predicted = type(manager_class_name(True), (), {})()
    waiting = type(manager_class_name(False), (), {})()

    def warning(name: str, msg: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    mismatch = (
        "the server's engine rules are 'state9-x', this client's 'state3-y' (another kvcoord release ...)"
    )
    check_manager(predicted, True, [])
    check_manager(waiting, False, [])
    with pytest.raises(AssertionError):
        check_manager(predicted, False, [])
    with pytest.raises(AssertionError, match="without the warning"):
        check_manager(waiting, True, [])
    unrelated = [warning("kvcoord.client.vllm", "KVCOORD_PREDICT: pool 'p' is not predicted (the pool holds routers' "
                         "reservations); running the waiting mode"),
                 warning("kvcoord.client.vllm", f"pool 'p' is not predicted ({mismatch})", logging.INFO),
                 warning("somebody.else", f"pool 'p' is not predicted ({mismatch})")]  # fmt: skip
    with pytest.raises(AssertionError, match="without the warning"):
        check_manager(waiting, True, unrelated)
    check_manager(waiting, True, [warning("kvcoord.client.vllm", f"KVCOORD_PREDICT: pool 'p' is not predicted "
                                          f"({mismatch}); running the waiting mode")])  # fmt: skip
    check_manager(waiting, True, [warning("kvcoord.client.vllm_losses", f"KVCOORD_PREDICT: pool 'p' can no longer "
                                          f"be predicted ({mismatch}); its requests are lost")])  # fmt: skip
