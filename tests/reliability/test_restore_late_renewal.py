"""A worker's renewal sent before a restored volume's kill and answered late: the
client's lease end it computes must not outlast the grace a proof of the restore
begins (the hunt of note36 I, hypothesis c: could a client believe its lease runs
while the restored server hands its blocks to another worker?).

Real server process, real files. Worker a keeps its session with a
:class:`SessionKeeper` over a client whose channel interceptor holds one Heartbeat's
answer: the server (the lost history's) answered it, the answer reaches the keeper
only after the server was SIGKILLed, its volume restored from a copy made before a's
last allocation, and started again. The late answer renews from its send (before the
kill), never from its arrival, and does not lower the fence's position; a's next
renewal, to the restored server, proves the restore (its fence names a record the
copy lacks): its session is lost, and no session attaches before the lease end the
late answer gave it has passed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
from durable_server import (
    attach,
    attach_after_grace,
    copy_volume,
    leased_server,
    restore_volume,
    step_allocate,
)
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, GracePeriodError
from kvcoord.client.session import SessionKeeper
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire.leases import LEASE_MARGIN


class _HoldOneHeartbeatAnswer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Once armed, the next Heartbeat is sent and answered, and its answer held until
    :attr:`release` is set."""

    def __init__(self) -> None:
        self.armed = False
        self.holding = threading.Event()
        self.release = threading.Event()

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        if self.armed and details.method.endswith("/Heartbeat"):
            self.armed = False
            outcome.result()  # answered by the server that is about to be killed
            self.holding.set()
            self.release.wait(120)
        return outcome


def test_a_renewal_answered_across_a_restore_gives_no_lease_end_past_the_grace(tmp_path: Path) -> None:
    lease = 8.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    hold = _HoldOneHeartbeatAnswer()
    copy = tmp_path / "volume-snapshot"
    try:
        with (
            KVCoordClient(server.address, interceptors=[hold], retry=NO_RETRY) as ca,
            KVCoordClient(server.address) as c,
        ):
            keeper = SessionKeeper(ca, lambda _previous: attach(ca, "worker-a", lease), renew=False)
            b = attach(c, "worker-b", lease)
            step_allocate(c, b, "b1", 8)
            copy_volume(server, copy)
            sync = pb.RequestSync(
                request_id="a2", append_token_ids=list(range(32)), new_request=True,
                append_block_hashes=[f"a2-{i}".encode().ljust(32, b".") for i in range(8)],
            )  # fmt: skip
            op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=32))
            answer = c.step("p", [op], keeper.session_id, keeper.fence)
            keeper.adopt(answer.fence)  # told more than the copy holds
            told_position = keeper.fence.position
            assert told_position > 0 and answer.results[0].status_code == 0
            hold.armed = True
            renewal = threading.Thread(target=keeper.heartbeat, daemon=True)
            renewal.start()
            assert hold.holding.wait(60), "the held renewal was never answered"
            restore_volume(server, copy)
            killed_at = time.monotonic()
            server.start()
            hold.release.set()  # the old server's answer arrives now, after the restore
            renewal.join(60)
            assert keeper.lost is None
            # renewed from its send (before the kill), not from its arrival
            assert keeper.valid_until <= killed_at + lease * (1 - LEASE_MARGIN)
            assert keeper.fence.position >= told_position  # the late answer lowers nothing
            keeper.heartbeat()  # its next renewal reaches the restored server: the proof
            assert isinstance(keeper.lost, FencedError), keeper.lost
            with KVCoordClient(server.address, retry=NO_RETRY) as probe:
                try:
                    attach(probe, "worker-c", lease)
                    raise AssertionError("a session attached inside the grace")
                except GracePeriodError:
                    pass
            d, attached_at = attach_after_grace(server.address, lease, "worker-d", 6 * lease)
            # no block can go to a new worker while worker a's client believed its lease ran
            assert attached_at >= keeper.valid_until
            given = step_allocate(c, d, "d1", 48)
            assert given
            keeper.close()
    finally:
        hold.release.set()
        server.stop()
