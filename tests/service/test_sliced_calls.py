"""A large allocation takes and caches its blocks in slices, a Free of many requests
frees them in slices: calls on other pools are answered between their slices, and
their answers are those of unsliced calls (a real server over real gRPC; the probes
run in a process of their own, as in test_sliced_steps.py)."""

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
from kvcoord.service.pool_service import PoolService
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import pool_toml

#: blocks of the probed allocation (one request, one engine allocation)
BLOCKS = 262_144

POOLS = pool_toml("a", BLOCKS + 8, caching=False, extra=f"max_model_len = {BLOCKS * 4}\n") + pool_toml(
    "b", 64, caching=False
)


def _op(rid: str, tokens: list[int], num_new_tokens: int) -> pb.AllocateOp:
    sync = pb.RequestSync(request_id=rid, new_request=True, append_token_ids=tokens)
    return pb.AllocateOp(request=sync, num_new_tokens=num_new_tokens)


def _probe(
    server: InProcessServer,
    progress: Callable[[PoolService], int],
    big: Callable[[KVCoordClient, str, pb.Fence], Any],
) -> tuple[list[int], Any]:
    """Call ``big(client, session, fence)`` on pool "a" (it signals ``started`` before
    its large call) and call pool "b" until it returns; returns ``progress`` of "a"
    each time "b" answered (read on the server's loop, as the answer is made) and
    what ``big`` returned."""
    registry = server.running.servicer.registry  # type: ignore[union-attr]
    a, b = registry.pools["a"], registry.pools["b"]
    seen: list[int] = []
    original_stats = b.lifetime_prefix_cache_stats

    def stats_seen() -> object:
        seen.append(progress(a))
        return original_stats()

    b.lifetime_prefix_cache_stats = stats_seen  # type: ignore[method-assign]
    answers: list[Any] = []
    done = threading.Event()

    def send_big() -> None:
        try:
            with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
                session = c.attach("a", "", 4, "")
                answers.append(big(c, session.session_id, session.fence))
        finally:
            done.set()

    sender = threading.Thread(target=send_big)
    sender.start()
    with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
        while not done.is_set():
            c.get_stats("b")
    sender.join(120)
    assert len(answers) == 1
    return seen, answers[0]


def probe_during_a_large_allocation(server: InProcessServer) -> list[int]:
    """Allocate BLOCKS blocks to one request of pool "a" (one Allocate call); the
    blocks "a" had taken each time a call on "b" was answered."""
    free = server.running.servicer.registry.pools["a"].engine.num_free_blocks  # type: ignore[union-attr]
    # a short prompt: the blocks past it are taken, not cached (no large message)
    seen, answer = _probe(
        server,
        lambda a: free - a.engine.num_free_blocks,
        lambda c, sid, fence: c.allocate("a", _op("big", [1, 2, 3, 4], BLOCKS * 4), sid, fence),
    )
    assert not answer.result.refused and len(answer.result.new_block_ids[0].block_ids) == BLOCKS
    return seen


#: requests freed by the probed Free (one block each)
FREED = 40_000


def probe_during_a_large_free(server: InProcessServer) -> list[int]:
    """Register FREED requests in pool "a", then free them in one Free call; the
    requests "a" had freed each time a call on "b" was answered (-1 before the Free)."""
    ids = [f"r{i}" for i in range(FREED)]
    freeing = threading.Event()  # set once every request is registered, before the Free

    def big(c: KVCoordClient, sid: str, fence: pb.Fence) -> pb.FreeResponse:
        step = [pb.Operation(allocate=_op(rid, [1, 2, 3, 4], 4)) for rid in ids]
        assert not any(r.status_code for r in c.step("a", step, sid, fence).results)
        freeing.set()
        return c.free("a", ids, session_id=sid, fence=fence)

    seen, _ = _probe(server, lambda a: FREED - len(a.engine.requests) if freeing.is_set() else -1, big)
    return seen


def _run_probe(name: str) -> list[int]:
    """``name`` (a probe of this module) run in a process of its own; what it returned."""
    code = (
        "import json, test_sliced_calls as t\n"
        "from kvcoord.service.testing import InProcessServer\n"
        "server = InProcessServer(t.POOLS).start()\n"
        "try:\n"
        f"    print(json.dumps(t.{name}(server)))\n"
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
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_another_pools_call_is_answered_between_the_slices_of_a_large_allocation() -> None:
    """Before, the allocation was one engine call: no call on "b" was answered while
    "a" had taken some of its blocks but not all."""
    taken_at_b = _run_probe("probe_during_a_large_allocation")
    during = [n for n in taken_at_b if 0 < n < BLOCKS]
    assert during, (
        f"no call on pool 'b' was answered while pool 'a' took its blocks (blocks taken at each: "
        f"{sorted(set(taken_at_b))[:10]} ...)"
    )


def test_another_pools_call_is_answered_between_the_slices_of_a_large_free() -> None:
    """Before, a Free was applied at once: no call on "b" was answered while "a" had
    freed some of its requests but not all."""
    freed_at_b = _run_probe("probe_during_a_large_free")
    during = [n for n in freed_at_b if 0 < n < FREED]
    assert during, (
        f"no call on pool 'b' was answered while pool 'a' freed its requests (requests freed at each: "
        f"{sorted(set(freed_at_b))[:10]} ...)"
    )


def test_a_sliced_allocation_answers_as_an_unsliced_one(make_server: Callable[..., InProcessServer]) -> None:
    """The same calls on two pools alike, the allocations of one cut into a slice at
    every chance and of the other whole: the same answers (their fences aside),
    events and pools afterwards; in a Step and alone, cached blocks evicted, refused."""
    two = POOLS.replace(f'name = "a"\nnum_blocks = {BLOCKS + 8}', 'name = "a"\nnum_blocks = 5000').replace(
        'name = "b"\nnum_blocks = 64\nhash_block_size = 4\n',
        f'name = "b"\nnum_blocks = 5000\nhash_block_size = 4\nmax_model_len = {BLOCKS * 4}\n',
    )
    server = make_server(two)
    mutations = server.running.servicer.mutations  # type: ignore[union-attr]
    got = {}
    with KVCoordClient(server.address, timeout=120, step_piece_bytes=0) as c:
        for pool, seconds in (("a", 0.0), ("b", 1e9)):
            mutations.slice_seconds = seconds
            session = c.attach(pool, "", 4, "")
            sid, fence = session.session_id, session.fence
            prompt = [(k * 31) % 97 for k in range(8192)]
            answers = [c.allocate(pool, _op("r1", prompt, 8192), sid, fence)]
            step = [pb.Operation(allocate=_op("r2", prompt[::-1] + prompt[:1000], 9192))]
            answers.append(c.step(pool, step, sid, fence, include_state=True))
            answers.append(c.free(pool, ["r1"], session_id=sid, fence=fence))
            # evicts r1's cached blocks; then one too large to fit is refused
            answers.append(c.allocate(pool, _op("r3", [5] * 10000, 10000), sid, fence))
            answers.append(c.allocate(pool, _op("r4", [6] * 12000, 12000), sid, fence))
            many = [f"m{i}" for i in range(100)]
            c.step(
                pool,
                [pb.Operation(allocate=_op(rid, [i % 7] * 9, 9)) for i, rid in enumerate(many)],
                sid,
                fence,
            )
            answers.append(c.free(pool, many, session_id=sid, fence=fence))
            answers.append(c.step(pool, [], sid, fence, include_state=True))
            for answer in answers:
                answer.ClearField("fence")
            got[pool] = ([a.SerializeToString() for a in answers], c.get_stats(pool).num_free_blocks)
    assert got["a"] == got["b"]
    allocated, refused = (
        pb.AllocateResponse.FromString(got["a"][0][3]),
        pb.AllocateResponse.FromString(got["a"][0][4]),
    )
    assert len(allocated.result.new_block_ids[0].block_ids) == 2500 and refused.result.refused
