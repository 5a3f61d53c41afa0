"""A session's Step that reaches the pool after the session's lease ran out, while the pool
is held by a Step applied in slices, over real gRPC (a hunt for a block handed to two
live requests, or a hit on KV nobody wrote).

- An exclusive session (an engine) whose lease runs out while its Step waits for the
  pool, and the next engine (a new session of the same client name) attaching
  meanwhile: the late Step is refused (SESSION_EXPIRED) whenever the pool reaches it,
  and so is a retry of a Step the lapsed session had applied (never its kept answer);
  the new engine starts from an empty pool and an empty cache.
- Two tenants with their own cache namespaces in one pool, one of them SIGKILLed (its
  client process) while its Step waits for the pool: until its lease ends, none of its
  blocks reaches the other tenant, whose identical prompt never hits its cached blocks;
  once it ends, a new session of the dead tenant does not hit them either (their KV may
  never have been written).

The pool is held as a Step applied in slices holds it (PoolLocks.take); the late call
is known to wait for it (PoolLocks.waiting) before the lease is made to run out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from support import pool_toml
from tenancy import Raw
from tenancy import pool_toml as tenant_pool

ALGO = "sha256_cbor"
NONE = none_hash(ALGO, "0")
PROMPT = list(range(500, 532))  # 8 full blocks of 4 tokens
OTHER = list(range(900, 932))
BLOCKS = 32
ALICE, BOB = "tok-alice", "tok-bob"
TENANTS = f"""
[tenants.alice]
tokens = ["{ALICE}"]
grants = [{{ pools = ["t*"], roles = ["use", "observe", "administer"] }}]

[tenants.bob]
tokens = ["{BOB}"]
grants = [{{ pools = ["t*"], roles = ["use", "observe", "administer"] }}]
"""


def _alloc(rid: str, tokens: list[int], lookup: bool = True) -> pb.Operation:
    sync = pb.RequestSync(
        request_id=rid,
        append_token_ids=tokens,
        append_block_hashes=BlockHasher(ALGO, 4, NONE).extend(tokens),
        new_request=True,
    )
    return pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=len(tokens), lookup=lookup))


def _attach(raw: Raw, pool: str, token: str | None, **kw: Any) -> Any:
    request = pb.AttachRequest(pool=pool, hash_algo=ALGO, hash_block_size=4, hash_seed="0", **kw)
    return raw.ok("Attach", request, token)


def _step(session: Any, pool: str, ops: list[pb.Operation], key: str = "") -> pb.StepRequest:
    return pb.StepRequest(pool=pool, session_id=session.session_id, fence=session.fence, ops=ops,
                          idempotency_key=key)  # fmt: skip


def _ids(result: pb.OperationResult) -> list[int]:
    a = result.allocate
    return [b for g in a.hit.groups for b in g.block_ids] + [b for g in a.new_block_ids for b in g.block_ids]


def _wait_until(what: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def _held_tables(raw: Raw, pool: str, token: str | None) -> dict[str, list[int]]:
    got = raw.ok("InspectPool", pb.InspectPoolRequest(pool=pool, all_requests=True), token)
    return {r.request_id: [b for g in r.groups for b in g.block_ids] for r in got.requests}


@pytest.fixture
def raw_of(
    make_server: Callable[..., InProcessServer],
) -> Iterator[Callable[[str], tuple[InProcessServer, Raw]]]:
    opened: list[Raw] = []

    def make(config: str) -> tuple[InProcessServer, Raw]:
        server = make_server(config)
        opened.append(Raw(server.address))
        return server, opened[-1]

    yield make
    for r in opened:
        r.close()


def test_a_lapsed_engines_late_step_after_the_next_engine_attached(
    raw_of: Callable[[str], tuple[InProcessServer, Raw]], clock: ManualClock
) -> None:
    server, raw = raw_of(pool_toml("p", BLOCKS))
    locks = server.running.servicer.registry.locks  # type: ignore[union-attr]
    first = _attach(raw, "p", None, client_name="engine", lease_seconds=10, exclusive=True,
                    reset_prefix_cache=True, attach_key="engine-1")  # fmt: skip
    applied = _step(first, "p", [_alloc("r1", PROMPT)], key="first-step")
    assert len(_ids(raw.ok("Step", applied, None).results[0])) == 8

    server.call(lambda: locks.take("p"))  # as a Step applied in slices holds it
    late = Raw(server.address)
    try:
        with ThreadPoolExecutor(2) as pool:
            in_flight = pool.submit(
                late.call, "Step", _step(first, "p", [_alloc("r2", OTHER)], "second-step"), None
            )
            _wait_until(lambda: server.call(lambda: locks.waiting("p")) == 1)  # the Step waits for the pool
            clock.advance(11)  # the first engine's lease runs out meanwhile
            second = pool.submit(_attach, raw, "p", None, client_name="engine", lease_seconds=10,
                                 exclusive=True, reset_prefix_cache=True, attach_key="engine-2")  # fmt: skip
            _wait_until(lambda: server.call(lambda: locks.waiting("p")) == 2)  # the lapsed session's end too
            assert not second.done() and not in_flight.done()
            server.call(lambda: locks.give("p"))  # the sliced Step is done
            code, detail = in_flight.result(20)
            attached = second.result(20)
    finally:
        late.close()
    assert code == grpc.StatusCode.NOT_FOUND and "lease ran out" in detail, (code, detail)
    assert (attached.pool.num_free_blocks, attached.pool.num_requests) == (BLOCKS - 1, 0)
    assert attached.prefix_cache_reset

    # the next engine's own requests: the first engine's prompt does not hit (reset)
    got = raw.ok("Step", _step(attached, "p", [_alloc("n1", PROMPT), _alloc("n2", OTHER)]), None)
    assert [r.allocate.hit.num_tokens for r in got.results] == [0, 0]
    mine = {rid: _ids(r) for rid, r in zip(("n1", "n2"), got.results, strict=True)}

    # the first engine's retry of a Step it had applied, and a late copy of the refused
    # one, arriving now: refused, and nothing changes
    for again in (applied, _step(first, "p", [_alloc("r2", OTHER)], "second-step")):
        code, detail = raw.call("Step", again, None)
        assert code == grpc.StatusCode.NOT_FOUND and "lease ran out" in detail, (code, detail)
    assert _held_tables(raw, "p", None) == mine
    assert not set(mine["n1"]) & set(mine["n2"])
    assert list(raw.ok("CheckPool", pb.CheckPoolRequest(pool="p"), None).violations) == []


_KILLED_CLIENT = """
import sys
import grpc
from kvcoord.v1 import allocator_pb2 as pb, allocator_pb2_grpc as pb_grpc
stub = pb_grpc.AllocatorStub(grpc.insecure_channel(sys.argv[1]))
request = pb.StepRequest.FromString(bytes.fromhex(sys.stdin.read()))
print("sending", flush=True)
stub.Step(request, metadata=[("authorization", "Bearer " + sys.argv[2])], timeout=120)
"""


def test_a_tenant_killed_mid_step_leaves_the_other_tenant_nothing_of_its_own(
    raw_of: Callable[[str], tuple[InProcessServer, Raw]], clock: ManualClock
) -> None:
    server, raw = raw_of(TENANTS + tenant_pool("t"))
    locks = server.running.servicer.registry.locks  # type: ignore[union-attr]
    a = _attach(raw, "t", ALICE, client_name="alice-engine", lease_seconds=10)
    b = _attach(raw, "t", BOB, client_name="bob-engine", lease_seconds=30)
    got = raw.ok("Step", _step(a, "t", [_alloc("a1", PROMPT)]), ALICE)  # cached, its KV never written
    alice_blocks = set(_ids(got.results[0]))
    assert len(alice_blocks) == 8

    # Alice's worker sends its next Step, which waits for the pool, and is SIGKILLed
    server.call(lambda: locks.take("t"))
    request = _step(a, "t", [_alloc("a2", OTHER)], key="alice-2")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, server.address, ALICE],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(request.SerializeToString().hex().encode())
        proc.stdin.close()
        assert proc.stdout.readline().strip() == b"sending"
        _wait_until(lambda: server.call(lambda: locks.waiting("t")) == 1)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(20) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(20)
        if proc.stdout is not None:
            proc.stdout.close()
    server.call(lambda: locks.give("t"))
    applied = _held_tables(raw, "t", ALICE)
    alice_blocks |= set(applied.get("a2", ()))  # (applied or not: either may happen)

    # Bob, same prompt (same hashes, his own namespace): no hit, and while Alice's lease
    # runs none of her blocks is his, however many he asks for
    got = raw.ok("Step", _step(b, "t", [_alloc("b1", PROMPT)]), BOB)
    assert got.results[0].allocate.hit.num_tokens == 0
    bobs = set(_ids(got.results[0]))
    n = 0
    while True:
        n += 1
        one = raw.ok("Step", _step(b, "t", [_alloc(f"b-fill{n}", [7000 + n] * 4, lookup=False)]), BOB)
        if one.results[0].allocate.refused:
            break
        bobs |= set(_ids(one.results[0]))
        assert n < 64
    assert not bobs & alice_blocks, sorted(bobs & alice_blocks)
    assert len(bobs) + len(alice_blocks) == 64 - 1  # every block is one of theirs (the null block aside)

    # Alice's lease ends: her blocks go back; a new session of hers does not hit them
    clock.advance(11)
    assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
    server.settle()
    again = _attach(raw, "t", ALICE, client_name="alice-engine", lease_seconds=10)
    got = raw.ok("Step", _step(again, "t", [_alloc("a3", PROMPT)]), ALICE)
    assert not got.results[0].allocate.refused
    assert got.results[0].allocate.hit.num_tokens == 0
    assert list(raw.ok("CheckPool", pb.CheckPoolRequest(pool="t"), ALICE).violations) == []
