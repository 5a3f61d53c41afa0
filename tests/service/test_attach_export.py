"""An exclusive Attach's engine state (want_engine_state) is encoded off the event
loop for a large pool (state_export.py), at the Attach's position, over real gRPC.

The export is held open at will: ``PoolService.mirror_state`` is wrapped to wait for a
file the test writes (bounded), after saying it started. Where the export runs on the
loop, that wait stands the whole server still and the probe on another pool is not
answered; where it runs in a forked child, the probe is answered while the Attach is
still waiting for its state."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import pytest
from durable_server import small_pool
from kvcoord.client import NO_RETRY, KVCoordClient, PoolBusyError, ResourceExhaustedError, UnavailableError
from kvcoord.service import state_export
from kvcoord.service.pool_service import PoolService
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import child_pids

#: seconds the held export waits for the test at most (never reached when it passes)
HOLD_LIMIT = 30.0


def _pools() -> str:
    """Two pools of full attention, 4-token blocks: "big" and "small"."""
    return small_pool(4096).replace('"p"', '"big"', 1) + small_pool(16).replace('"p"', '"small"', 1)


def _hold_exports(monkeypatch: pytest.MonkeyPatch, started: Path, go: Path) -> None:
    original = PoolService.mirror_state

    def held(self: PoolService, cache_namespace: str) -> Any:
        started.write_text("started")
        deadline = time.monotonic() + HOLD_LIMIT
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return original(self, cache_namespace)

    monkeypatch.setattr(PoolService, "mirror_state", held)


def _fill(c: KVCoordClient, pool: str, requests: int) -> None:
    """Requests that allocate and free (their blocks stay in the prefix cache)."""
    s = c.attach(pool, "sha256_cbor", 4, "0")
    for n in range(requests):
        tokens = list(range(n * 1000, n * 1000 + 64))
        got = c.allocate(pool, allocate(f"r{n}", tokens, 64).allocate, s.session_id, s.fence)
        assert not got.result.refused
        c.free(pool, [f"r{n}"], session_id=s.session_id, fence=s.fence)
    c.detach(s.session_id, s.fence)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + HOLD_LIMIT
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def _exported(server: InProcessServer, pool: str) -> Any:
    """The pool's engine state now, as a mirror decodes it (read on the server's loop)."""
    service = server.running.servicer.registry.pools[pool]  # type: ignore[union-attr]
    return server.call(lambda: cbor2.loads(cbor2.dumps(service.export_state())))


def test_a_large_pools_state_is_exported_while_other_pools_are_answered(
    make_server: Callable[..., InProcessServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_export, "FORK_BLOCKS", 64)  # "big" passes it, the rule is what is tested
    server = make_server(_pools())
    started, go = tmp_path / "started", tmp_path / "go"
    with KVCoordClient(server.address, timeout=10) as c:
        _fill(c, "big", 40)
        before = _exported(server, "big")
        assert before["cached_blocks"], "the pool holds cached blocks"
        _hold_exports(monkeypatch, started, go)
        answers: list[pb.AttachResponse] = []
        attach = threading.Thread(
            target=lambda: answers.append(
                c.attach(
                    "big", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True, want_engine_state=True
                )
            ),
            daemon=True,
        )
        attach.start()
        try:
            _wait_for(started)
            with KVCoordClient(server.address, timeout=5, retry=NO_RETRY) as probe:
                assert probe.get_pool("small").pool.name == "small"  # answered during the export
                # the pool changes while its state is exported: the answer keeps the Attach's.
                # Only the exclusive session may reset it (an operator's reset would void
                # its mirror's answers: refused, HUNTPRED2), so the reset names it.
                with pytest.raises(PoolBusyError):
                    probe.reset_prefix_cache("big")
                (held,) = probe.list_sessions("big").sessions
                assert probe.reset_prefix_cache("big", held.session_id).result
            assert attach.is_alive() and not answers, "the Attach waits for its state meanwhile"
        finally:
            go.write_text("go")
            attach.join(HOLD_LIMIT)
    assert len(answers) == 1
    state = answers[0].pool_state
    assert state.engine_state_version and state.engine_rules
    assert cbor2.loads(state.engine_state) == before
    after = _exported(server, "big")
    assert after != before and not after["cached_blocks"]


def test_an_export_too_large_for_one_answer_leaves_no_session(
    make_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size check runs on the exported state: refused ANSWER_TOO_LARGE, and the
    session made for it is gone (another session may attach)."""
    monkeypatch.setattr(state_export, "FORK_BLOCKS", 64)
    server = make_server(_pools(), max_message_bytes=6000)
    with KVCoordClient(server.address, timeout=10) as c:
        _fill(c, "big", 40)
        with pytest.raises(ResourceExhaustedError, match="more than one answer may"):
            c.attach(
                "big", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True, want_engine_state=True
            )
        assert not server.running.servicer.registry.sessions.sessions  # type: ignore[union-attr]
        s = c.attach("big", "sha256_cbor", 4, "0", exclusive=True)
        assert s.exclusive


def test_an_attach_given_up_during_its_export_kills_the_child_and_leaves_no_session(
    make_server: Callable[..., InProcessServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's deadline passes while the state is encoded: the child is killed,
    the session made for the Attach ends, and the pool takes an exclusive session again."""
    monkeypatch.setattr(state_export, "FORK_BLOCKS", 64)
    server = make_server(_pools())
    started, go = tmp_path / "started", tmp_path / "go"
    with KVCoordClient(server.address, timeout=10) as c:
        _fill(c, "big", 40)
        before = set(child_pids(os.getpid()))
        _hold_exports(monkeypatch, started, go)
        with KVCoordClient(server.address, timeout=2, retry=NO_RETRY) as impatient:
            with pytest.raises(UnavailableError):
                impatient.attach(
                    "big", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True, want_engine_state=True
                )
        assert started.exists(), "the export had started"
        registry = server.running.servicer.registry  # type: ignore[union-attr]
        deadline = time.monotonic() + HOLD_LIMIT
        while (
            set(child_pids(os.getpid())) - before or registry.sessions.sessions
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not set(child_pids(os.getpid())) - before, "the child encoding the state was killed"
        assert not registry.sessions.sessions
        go.write_text("go")
        assert c.attach("big", "sha256_cbor", 4, "0", exclusive=True).exclusive
