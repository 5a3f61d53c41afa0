"""A large Step is applied in slices: calls on other pools are answered between its
slices, calls on its own pool wait for it, and its answer is the one an unsliced
Step gives (a real server over real gRPC)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import one_block_allocations
from support import pool_toml

#: operations of the large Step (each registers a request and allocates one block)
N = 6000
#: operations of the Step other pools are probed during: long enough for many slices
#: on a fast, quiet machine too (a call on another pool needs several turns of the
#: loop, one between two slices each, to be read, handled and answered)
N_PROBED = 30000

TWO_POOLS = pool_toml("a", 40000, caching=False) + pool_toml("b", 64, caching=False)


def _big_step(prefix: str = "r", n: int = N) -> list[pb.Operation]:
    return one_block_allocations(prefix, n)


def _count_syncs(server: InProcessServer, pool: str) -> list[int]:
    """Count, on the server, the request syncs pool ``pool`` applies (one per operation
    of the big Step); the list holds the count."""
    service = server.running.servicer.registry.pools[pool]  # type: ignore[union-attr]
    seen = [0]
    syncs = service.syncs  # the pool's request syncs (pool_requests.py), which its Step calls
    original: Callable[..., Any] = syncs.sync

    def counting(*args: Any) -> Any:
        seen[0] += 1
        return original(*args)

    syncs.sync = counting  # type: ignore[method-assign]
    return seen


def probe_during_a_large_step(server: InProcessServer) -> list[int]:
    """Send one N_PROBED-operation Step to pool "a" and call pool "b" until it is
    answered; returns what "a" had applied of it each time "b" answered."""
    applied = _count_syncs(server, "a")
    # what pool "a" had applied of the big Step each time a call on "b" was answered
    # (read on the server's loop, as the answer is made)
    progress_at_b: list[int] = []
    b = server.running.servicer.registry.pools["b"]  # type: ignore[union-attr]
    original_stats = b.lifetime_prefix_cache_stats

    def stats_seen() -> Any:
        progress_at_b.append(applied[0])
        return original_stats()

    b.lifetime_prefix_cache_stats = stats_seen  # type: ignore[method-assign]
    answers: list[pb.StepResponse] = []
    done = threading.Event()

    def send_big() -> None:
        with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
            session = c.attach("a", "", 4, "")
            answers.append(c.step("a", _big_step(n=N_PROBED), session.session_id, session.fence))
        done.set()

    sender = threading.Thread(target=send_big)
    sender.start()
    with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
        while not applied[0] and sender.is_alive():  # until pool "a" applies its first operation
            c.get_stats("b")
        while not done.is_set():
            c.get_stats("b")
    sender.join(120)
    assert len(answers) == 1 and len(answers[0].results) == N_PROBED
    assert all(r.status_code == 0 and not r.allocate.refused for r in answers[0].results)
    return progress_at_b


def test_another_pools_call_is_answered_between_the_slices_of_a_large_step() -> None:
    """Run in a process of its own, as a server is: no other test's threads share its
    GIL. On a quiet machine this failed while the loop paused between slices with
    ``sleep(0)`` (gRPC's poller never got the GIL to hand over the probe's call);
    it needs turns.SLICE_PAUSE."""
    code = (
        "import json, test_sliced_steps as t\n"
        "from kvcoord.service.testing import InProcessServer\n"
        "server = InProcessServer(t.TWO_POOLS).start()\n"
        "try:\n"
        "    print(json.dumps(t.probe_during_a_large_step(server)))\n"
        "finally:\n"
        "    server.stop()\n"
    )
    here = Path(__file__).resolve().parent
    root = here.parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(root / d) for d in ("client", "server", "tests"))
        + os.pathsep
        + str(here),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    progress_at_b = json.loads(done.stdout.strip().splitlines()[-1])
    during = [p for p in progress_at_b if 0 < p < N_PROBED]
    assert during, (
        f"no call on pool 'b' was answered while pool 'a' applied its Step (progress seen at each: "
        f"{sorted(set(progress_at_b))[:10]} ...)"
    )


def test_a_sliced_step_answers_as_an_unsliced_one(make_server: Callable[..., InProcessServer]) -> None:
    """The same Step on two pools alike, once cut into a slice every 64 operations and
    once whole: the same answer (their fences aside), the same pool afterwards."""
    two = TWO_POOLS.replace('name = "b"\nnum_blocks = 64', 'name = "b"\nnum_blocks = 40000')
    server = make_server(two)
    mutations = server.running.servicer.mutations  # type: ignore[union-attr]
    got = {}
    with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
        for pool, seconds in (("a", 0.0), ("b", 1e9)):
            mutations.slice_seconds = seconds
            session = c.attach(pool, "", 4, "")
            ops = _big_step()
            # a failing operation in the middle: the rest are aborted in both
            ops[N // 2] = pb.Operation(free=pb.FreeOp(request_id="unknown"))
            answer = c.step(pool, ops, session.session_id, session.fence, include_state=True)
            answer.ClearField("fence")
            # (the failed operation's message names its pool)
            body = answer.SerializeToString().replace(f"pool '{pool}'".encode(), b"pool 'x'")
            got[pool] = (body, c.get_stats(pool).num_free_blocks)
    assert got["a"] == got["b"]


def test_a_call_on_the_same_pool_waits_for_the_sliced_step(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A call on the pool a sliced Step is applied to is answered after that Step is
    done with it: it sees all of it."""
    server = make_server(TWO_POOLS)
    applied = _count_syncs(server, "a")
    seen: list[int] = []
    with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
        session = c.attach("a", "", 4, "")

        def send_big() -> None:
            with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c2:
                c2.step("a", _big_step(), session.session_id, session.fence)

        sender = threading.Thread(target=send_big)
        sender.start()
        while not applied[0] and sender.is_alive():
            pass
        seen.append(c.get_stats("a").num_requests)
        sender.join(120)
    assert seen == [N]


def test_calls_queued_behind_a_sliced_step_each_hold_the_pool_for_their_own_slices(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Four sliced Steps on one pool at once (every Step cut after its first slice):
    each call that waited for the pool must hold it for its own slices. A call that
    only waited ran on while the pool had been handed to the next waiter, and its own
    slicing then failed with INTERNAL ("pool 'a' is held already")."""
    server = make_server(TWO_POOLS)
    server.running.servicer.mutations.slice_seconds = 0.0  # type: ignore[union-attr]
    errors: list[BaseException] = []
    with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
        session = c.attach("a", "", 4, "")

        def send(k: int) -> None:
            try:
                with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as ck:
                    answer = ck.step("a", _big_step(f"w{k}-", 1500), session.session_id, session.fence)
                    assert all(r.status_code == 0 for r in answer.results)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        senders = [threading.Thread(target=send, args=(k,)) for k in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
        assert not errors, errors
        assert c.get_stats("a").num_requests == 4 * 1500
