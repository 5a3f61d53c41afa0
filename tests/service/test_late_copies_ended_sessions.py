"""A copy of a keyed call delivered after its session ended (Detach, or its lease ran
out). The session's keys and its call_sequence floor go with it (idempotency.py:
drop_session), so what refuses the copy is the session itself: NOT_FOUND
(SESSION_EXPIRED), never applied, also after a restart from the journal. Meanwhile
another session admitted a request under the same id (vLLM reuses ids): applied, a
late Free would free its live blocks, a late Allocate take the id back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer, ManualClock
from late_copies import LEASE, PROMPT, SETTINGS, assert_refused, send_raw, tables
from support import pool_toml


def _refused_as_ended(address: str, rpc: str, request: Any) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        send_raw(address, rpc, request)
    assert_refused(refused.value, grpc.StatusCode.NOT_FOUND, "SESSION_EXPIRED")


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restarted"])
@pytest.mark.parametrize("end", ["detach", "lease"])
def test_a_late_copy_naming_an_ended_session_is_never_applied(
    make_server: Callable[..., InProcessServer], clock: ManualClock, tmp_path: Path, end: str, restart: bool
) -> None:
    data = str(tmp_path / "data")
    wall = lambda: 1.7e9 + clock.now  # noqa: E731
    server = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall, **SETTINGS)
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        a, a_fence = attach(client)
        admitting = KVCoordClient.step.build("p", [allocate("r1", PROMPT, 8)], a, a_fence)
        assert send_raw(server.address, "Step", admitting).results[0].status_code == 0
        freeing = KVCoordClient.free.build("p", ["r1"], session_id=a, fence=a_fence)
        send_raw(server.address, "Free", freeing)
        if end == "detach":
            client.detach(a, a_fence, pool="p")
        else:  # A's lease runs out (B renews its own meanwhile); the reaper ends A
            b0, b0_fence = attach(client)
            for _ in range(3):
                clock.advance(LEASE / 2)
                client.heartbeat(b0, b0_fence, pool="p")
            assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
        b, b_fence = attach(client)
        assert client.step("p", [allocate("r1", PROMPT, 8)], b, b_fence).results[0].status_code == 0
        held = tables(client)
        assert len(held["r1"]) == 2
        free_before = client.get_stats("p").num_free_blocks
    if restart:
        server.stop(snapshot=False)
        server = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall, **SETTINGS)
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        if restart:
            client.heartbeat(b, b_fence, pool="p")
        _refused_as_ended(server.address, "Free", freeing)
        _refused_as_ended(server.address, "Step", admitting)
        assert tables(client) == held
        assert client.get_stats("p").num_free_blocks == free_before
