"""Replaying a journaled call that named calls its client gave up on (``abandoned``)
makes their tombstones again whatever the byte budget is now: a restart with a smaller
``idempotency_max_bytes`` starts, and the tombstones still refuse their keys. (Live, a
call whose tombstones do not fit is refused before it is journaled; a journaled one was
applied and must replay, as its own key does: ``remember`` never refuses. Before the
fix, recovery stopped: "record 5 cannot be replayed: ... is refused (idempotency_max_bytes
... is taken by the 40 keys ...) though its client was told it was applied".)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from helpers import attach
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import AnswerEvictedError, error_from_rpc
from kvcoord.service.idempotency import entry_bytes
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from support import pool_toml

NAMED = 200


def _free(address: str, request: pb.FreeRequest) -> None:
    """Deliver a Free as a late copy would arrive (no client retries, no naming)."""
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.AllocatorStub(channel).Free(request, timeout=10)
        except grpc.RpcError as err:
            raise error_from_rpc(err, "Free") from None


def test_a_restart_with_a_smaller_budget_replays_a_call_naming_given_up_calls(
    make_server: Callable[..., InProcessServer], clock: ManualClock, tmp_path: Path
) -> None:
    data = str(tmp_path / "data")
    wall = lambda: 1.7e9 + clock.now  # noqa: E731
    server = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall)
    with KVCoordClient(server.address, timeout=10, step_stream=False) as client:
        a, a_fence = attach(client)
        lost = [pb.AbandonedCall(idempotency_key=f"lost-{n:027d}", call_sequence=n + 1) for n in range(NAMED)]
        request = pb.StepRequest(
            pool="p", session_id=a, fence=a_fence, idempotency_key="k" * 32, call_sequence=NAMED + 1,
            abandoned=lost,
        )  # fmt: skip
        client.send_step(request)  # applied and journaled, its tombstones in its record
    server.stop(snapshot=False)  # recovered from the journal: the call is replayed
    small = 40 * entry_bytes(a, lost[0].idempotency_key)  # a fifth of the tombstones
    server = make_server(pool_toml("p", 16), data_dir=data, wall_clock=wall, idempotency_max_bytes=small)
    for call in (lost[0], lost[-1]):
        late = pb.FreeRequest(
            pool="p", session_id=a, request_ids=["r1"], idempotency_key=call.idempotency_key,
            call_sequence=call.call_sequence,
        )  # fmt: skip
        with pytest.raises(AnswerEvictedError):
            _free(server.address, late)
