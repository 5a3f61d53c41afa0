"""A Step applied in slices is one journal record: a server SIGKILLed while it
applies one (other pools' calls answered meanwhile) finds, once restarted, either
all of it or none of it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from durable_server import DurableServer
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import one_block_allocations
from support import pool_toml

N = 20000

POOLS = "".join(
    pool_toml(name, blocks, caching=False) for name, blocks in (("a", N + 1000), ("b", 64), ("c", N + 1000))
)


def _step(prefix: str) -> list[pb.Operation]:
    return one_block_allocations(prefix, N)


def test_a_step_killed_while_applied_in_slices_is_all_or_none(tmp_path: Path) -> None:
    server = DurableServer(tmp_path, POOLS)
    server.start()
    try:
        with KVCoordClient(server.address, timeout=300, retry=NO_RETRY) as c:
            # how long such a Step takes here (pool "c"): the kill comes about halfway
            sc = c.attach("c", "", 4, "")
            t0 = time.monotonic()
            c.step("c", _step("c"), sc.session_id, sc.fence)
            took = time.monotonic() - t0
            sa = c.attach("a", "", 4, "")
            outcome: list[object] = []

            def send() -> None:
                with KVCoordClient(server.address, timeout=300, retry=NO_RETRY) as c2:
                    try:
                        outcome.append(c2.step("a", _step("a"), sa.session_id, sa.fence))
                    except KVCoordError as exc:  # killed before it answered
                        outcome.append(exc)

            sender = threading.Thread(target=send)
            sent = time.monotonic()
            sender.start()
            answered_b = 0
            while sender.is_alive() and time.monotonic() - sent < took / 2:
                c.get_stats("b")
                answered_b += 1
            c.get_stats("b")  # answered while the Step may still be applied: the loop is not held
            server.kill()
            sender.join(60)
        server.start()
        with KVCoordClient(server.address, timeout=60) as c:
            held = c.get_stats("a").num_requests
            assert c.get_stats("c").num_requests == N
        assert held in (0, N), f"a Step cut by SIGKILL left {held} of its {N} requests"
        if isinstance(outcome[0], pb.StepResponse):  # answered before the kill: it must be there
            assert held == N
    finally:
        server.stop()
