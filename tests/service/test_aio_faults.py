"""The asyncio client under lost, late, duplicated and reordered answers
(:class:`~kvcoord.client.faults_aio.AsyncFaultInjector` on its channel, a real server,
real gRPC), as the blocking client's fault tests drive the blocking one
(test_free_pieces_faults.py, test_client.py, test_step_pieces.py): every mutating call
ends with exactly what the client was told, or a typed OutcomeUnknownError, never a
silent difference."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
from kvcoord.client import AsyncKVCoordClient, KVCoordClient, OutcomeUnknownError, UnavailableError, given_up
from kvcoord.client.api import Api
from kvcoord.client.errors import LocalRpcError
from kvcoord.client.faults import FaultInjector
from kvcoord.client.faults_aio import AsyncFaultInjector
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.retry import RetryPolicy
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import pool_toml

CAP = 4  # the server's max_ops_per_step: a Step or Free of 10 goes in three pieces
N = 10
ROUNDS = 5
TOML = pool_toml("p", 256)
KEYED = ("Step", "Allocate", "Free")


def _ops(round_: int) -> list[pb.Operation]:
    """Register and allocate r0..r9 (the same ids every round), sharing a prefix with
    the last round's prompts (cache hits), growing a little each round."""
    return [
        allocate(f"r{i}", [*range(16), *range(100 * i, 100 * i + 4 + round_)], 20 + round_) for i in range(N)
    ]


def _state(c: KVCoordClient) -> pb.InspectPoolResponse:
    return c.inspect_pool("p", free_queue_limit=1000, all_requests=True, include_cached_blocks=True)


def _stats(c: KVCoordClient) -> tuple[int, int, pb.PrefixCacheStats]:
    stats = c.get_stats("p")
    return stats.num_free_blocks, stats.num_requests, stats.prefix_cache_stats


async def _rounds(address: str, interceptors: Sequence[Any] = ()) -> list[Any]:
    """ROUNDS rounds, on one asyncio client: allocate r0..r9 in one Step (three pieces),
    one more request by Allocate, free them all in one Free (three pieces); every
    answer the client was told (block ids, results, free counts)."""
    told: list[Any] = []
    async with AsyncKVCoordClient(address, timeout=10, interceptors=list(interceptors)) as c:
        s = await c.attach("p", "sha256_cbor", 4, "0")
        for k in range(ROUNDS):
            got = await c.step("p", _ops(k), s.session_id, s.fence)
            told.append([(r.status_code, r.allocate) for r in got.results])
            one = allocate(f"x{k}", [*range(16), 900 + k], 17).allocate
            told.append((await c.allocate("p", one, s.session_id, s.fence)).result)
            ids = [*(f"r{i}" for i in range(N)), f"x{k}"]
            told.append((await c.free("p", ids, session_id=s.session_id, fence=s.fence)).num_free_blocks)
    return told


def test_lost_late_and_repeated_answers_of_keyed_calls_apply_each_once(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Per seed, the same rounds on a calm server and on one behind the faults (Steps
    and Frees in pieces, Allocates): equal answers (every block id told), pool state
    (block tables, free queue, cached blocks) and statistics; across the seeds every
    kind of fault is drawn."""
    drawn = dict.fromkeys(("dropped", "delayed", "duplicated", "reordered"), 0)
    for seed in range(4):
        calm = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
        faulty = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
        want = asyncio.run(_rounds(calm.address))
        faults = AsyncFaultInjector(seed, drop=0.2, delay=0.15, duplicate=0.15, reorder=0.4, methods=KEYED)
        got = asyncio.run(_rounds(faulty.address, [faults]))
        assert faults.counts["calls"] >= ROUNDS * 7
        assert got == want, f"seed {seed}: the answers told differ from a fault-free run"
        with KVCoordClient(calm.address) as a, KVCoordClient(faulty.address) as b:
            assert _state(b) == _state(a), f"seed {seed}: the pool's state differs from a fault-free run"
            assert _stats(b) == _stats(a), f"seed {seed}"
        for k in drawn:
            drawn[k] += faults.counts[k]
        calm.stop()
        faulty.stop()
    assert all(drawn.values()), drawn


def test_the_draw_is_the_blocking_injectors() -> None:
    """Both injectors follow one rule (faults.FaultRules): the same seed draws the same
    faults, call for call."""
    sync, aio = (
        FaultInjector(7, drop=0.2, delay=0.2, duplicate=0.2, reorder=0.3),
        AsyncFaultInjector(7, drop=0.2, delay=0.2, duplicate=0.2, reorder=0.3),
    )
    held_a: list[Any] = []
    held_b: list[Any] = []
    a = [sync._draw(i, held_a) for i in range(200)]
    b = [aio._draw(i, held_b) for i in range(200)]
    assert a == b and sync.counts == aio.counts


class FirstAnswersLost(AsyncFaultInjector):
    """The first delivery of each request of ``methods`` is applied and its answer lost
    (``fault``: "drop", UNAVAILABLE; "delay", DEADLINE_EXCEEDED) or it is delivered twice
    ("duplicate"); its retries (the same request) pass."""

    def __init__(self, fault: str, methods: Sequence[str]) -> None:
        super().__init__(0, methods=methods)
        self.fault = fault
        self.seen: set[bytes] = set()

    def _draw(self, item: Any, held: list[Any]) -> tuple[str, Any]:
        body = item[1].SerializeToString(deterministic=True)
        self.counts["calls"] += 1
        if body in self.seen:
            return "none", None
        self.seen.add(body)
        return self.fault, None


NONE = none_hash("sha256_cbor", "0")
PROMPT = [7000 + i for i in range(41)]


def _prompt() -> list[pb.HashedPrompt]:
    hashes = BlockHasher("sha256_cbor", 4, NONE).extend(PROMPT)
    return [pb.HashedPrompt(hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes)]


def _held(c: KVCoordClient) -> dict[str, list[int]]:
    return {
        r.request_id: list(r.groups[0].block_ids) for r in c.inspect_pool("p", all_requests=True).requests
    }


async def _lost_call(address: str, rpc: str, faults: AsyncFaultInjector) -> tuple[Any, Any, Any]:
    """Set up what ``rpc`` needs on a calm client, then make the call on a client
    behind ``faults``: (the answer or the error raised, the session, what the blocking
    client then reads of the pool)."""
    async with AsyncKVCoordClient(address, timeout=10) as calm:
        s = await calm.attach("p", "sha256_cbor", 4, "0", client_name="setup")
        await calm.step(
            "p", [allocate(f"h{i}", [*range(16), 500 + i], 17) for i in range(6)], s.session_id, s.fence
        )
        await calm.step("p", [allocate("cached", PROMPT, 41)], s.session_id, s.fence)
        await calm.free("p", ["cached"], session_id=s.session_id, fence=s.fence)
        if rpc == "ResetPrefixCache":  # (refused while any block is held, as vLLM's)
            await calm.free("p", [f"h{i}" for i in range(6)], session_id=s.session_id, fence=s.fence)
    async with AsyncKVCoordClient(address, timeout=10, interceptors=[faults]) as c:
        calls: dict[str, Callable[[], Any]] = {
            "CreatePool": lambda: c.create_pool("q", _wire_config()),
            "DeletePool": lambda: c.delete_pool("p", force=True),
            "Attach": lambda: c.attach("p", "sha256_cbor", 4, "0", client_name="w", exclusive=False),
            "Heartbeat": lambda: c.heartbeat(s.session_id, s.fence),
            "Detach": lambda: c.detach(s.session_id, s.fence),
            "Allocate": lambda: c.allocate(
                "p", allocate("a", [*range(16), 77], 17).allocate, s.session_id, s.fence
            ),
            "Step": lambda: c.step("p", [allocate("a", [*range(16), 77], 17)], s.session_id, s.fence),
            "Step in pieces": lambda: c.step(
                "p", [allocate(f"a{i}", [*range(16), 70 + i], 17) for i in range(N)], s.session_id, s.fence
            ),
            "Free": lambda: c.free("p", ["h0", "h1"], session_id=s.session_id, fence=s.fence),
            "Free in pieces": lambda: c.free(
                "p", [f"h{i}" for i in range(6)], session_id=s.session_id, fence=s.fence
            ),
            "ResetPrefixCache": lambda: c.reset_prefix_cache("p"),
            "ScorePools": lambda: c.score_pools(len(PROMPT), _prompt(), reserve_seconds=30.0),
        }
        c.step_piece_ops = CAP
        try:
            told: Any = await calls[rpc]()
        except Exception as exc:  # the typed error is the answer
            told = exc
    with KVCoordClient(address, timeout=10) as check:
        pools = [p.name for p in check.list_pools().pools]
        seen: dict[str, Any] = {"pools": pools}
        if "p" in pools:
            seen["held"] = _held(check)
            seen["sessions"] = sorted(x.client_name for x in check.list_sessions("p").sessions)
            stats = check.get_stats("p")
            seen["reservations"] = stats.reservations.made
            seen["cached"] = list(check.inspect_pool("p", include_cached_blocks=True).cached_block_ids)
    return told, s, seen


def _wire_config() -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=32,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
        hash_block_size=4,
        enable_caching=True,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )


HELD = {f"h{i}" for i in range(6)}


def _blocks(result: pb.AllocateResult) -> list[int]:
    return list(result.new_block_ids[0].block_ids)


def _check(fault: str, rpc: str, told: Any, seen: dict[str, Any]) -> None:
    """What the client was told is what the server holds (or OutcomeUnknownError for a
    once-only call, whose effect is then found applied)."""
    if rpc in ("DeletePool", "Detach", "ResetPrefixCache"):
        assert isinstance(told, OutcomeUnknownError), repr(told)
    elif rpc in ("CreatePool", "Heartbeat") and fault == "delay":
        # a read or no-op call is not retried past its deadline: told so (typed), its
        # effect harmless either way (the same pool, a lease renewed)
        assert isinstance(told, UnavailableError) and told.code == grpc.StatusCode.DEADLINE_EXCEEDED, repr(
            told
        )
        return
    else:
        assert not isinstance(told, Exception), repr(told)
    if rpc == "DeletePool":
        assert seen["pools"] == [], seen
        return
    held = seen["held"]
    if rpc == "CreatePool":
        assert seen["pools"] == ["p", "q"]
    elif rpc == "Attach":
        assert seen["sessions"] == ["setup", "w"] and told.session_id
    elif rpc == "Detach":
        assert seen["sessions"] == [] and held == {}
    elif rpc in ("Allocate", "Step"):
        blocks = _blocks(told.result if rpc == "Allocate" else told.results[0].allocate)
        assert held.pop("a") == blocks and blocks
    elif rpc == "Step in pieces":
        assert len(told.results) == N and all(r.status_code == 0 for r in told.results)
        for i, r in enumerate(told.results):
            assert held.pop(f"a{i}") == _blocks(r.allocate)
    elif rpc in ("Free", "Free in pieces"):
        gone = {"h0", "h1"} if rpc == "Free" else HELD
        assert set(held) == HELD - gone
        return
    elif rpc == "ResetPrefixCache":
        assert seen["cached"] == [] and held == {}
        return
    elif rpc == "ScorePools":
        assert told.HasField("reservation") and seen["reservations"] == 1
    if rpc != "Detach":
        assert set(held) == HELD, held
    if rpc not in ("Detach", "ResetPrefixCache"):
        assert seen["cached"], seen  # (the reset's check sees a cache to reset)


MUTATING = [
    "CreatePool",
    "DeletePool",
    "Attach",
    "Heartbeat",
    "Detach",
    "Allocate",
    "Step",
    "Step in pieces",
    "Free",
    "Free in pieces",
    "ResetPrefixCache",
    "ScorePools",
]
#: (the "once" calls carry no key: the network delivering one twice is told as the
#: second copy's answer, as to the blocking client)
TWICE_SAFE = [rpc for rpc in MUTATING if rpc not in ("DeletePool", "Detach", "ResetPrefixCache")]


@pytest.mark.parametrize(
    ("fault", "rpc"),
    [("drop", rpc) for rpc in MUTATING]
    + [("delay", rpc) for rpc in MUTATING]
    + [("duplicate", rpc) for rpc in TWICE_SAFE],
)
def test_a_mutating_call_whose_answer_is_lost_ends_as_the_client_was_told(
    make_server: Callable[..., InProcessServer], fault: str, rpc: str
) -> None:
    """Each mutating call of the asyncio client, applied by the server and its answer
    lost (or late, or the request delivered twice): the pool ends as the answer told
    (the blocks it names held, once; the requests it freed gone; one session, one
    reservation), or the call is told OutcomeUnknownError and its effect is found."""
    server = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
    name = rpc.split()[0]
    faults = FirstAnswersLost(fault, [name])
    told, _, seen = asyncio.run(_lost_call(server.address, rpc, faults))
    assert faults.counts[{"drop": "dropped", "delay": "delayed", "duplicate": "duplicated"}[fault]], (
        faults.counts
    )
    _check(fault, rpc, told, seen)


class HoldFirst(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The first call of ``method`` is held back on the way (a congested link, a proxy's
    buffer); a copy of it reaches the server only at :meth:`release`, whatever became
    of its caller. Meanwhile its caller waits (``cut`` False) or is told the connection
    broke, UNAVAILABLE, as is every retry while ``cut`` is True."""

    def __init__(self, method: str, cut: bool = False) -> None:
        self.method = method
        self.cut = cut
        self.held = asyncio.Event()
        self.go = asyncio.Event()
        self.late: asyncio.Task[Any] | None = None
        self.answer: Any = None

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        if not details.method.decode().endswith("/" + self.method):
            return await continuation(details, request)
        if self.late is None:
            self.late = asyncio.ensure_future(self._deliver_late(continuation, details, request))
            self.held.set()
            if not self.cut:
                return await asyncio.shield(self.late)
        if self.cut:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: the connection broke after sending")
        return await continuation(details, request)

    async def _deliver_late(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        await self.go.wait()
        call = await continuation(details, request)
        try:
            self.answer = await call
        except grpc.RpcError as exc:
            self.answer = exc
        return call

    async def release(self) -> Any:
        """Deliver the held copy; what the server answered it (the answer or the error)."""
        self.go.set()
        assert self.late is not None
        await self.late
        return self.answer


#: two attempts (the second after the first's UNAVAILABLE), then the final error
POLICY = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)


@pytest.mark.parametrize("how", ["cancelled", "given-up"])
def test_a_keyed_call_cancelled_or_given_up_is_never_applied_late(server: InProcessServer, how: str) -> None:
    """An asyncio caller cancels a Free in flight (``asyncio.wait_for``, a task
    cancelled), or the client gives it up (OutcomeUnknownError: every attempt cut off):
    either way the caller cannot know whether it was applied, frees the request again and
    admits it again under the same id (vLLM reuses a preempted request's id). The first
    Free, held back on the way, then arrives: it must not free the new request's blocks.
    The client names the call in its session's next keyed calls (given_up.py), so the
    late copy is refused ANSWER_EVICTED, never applied (old code, cancelled: the late
    Free freed the request admitted again, its blocks gone under its owner, the pool
    holding nothing)."""
    hold = HoldFirst("Free", cut=how == "given-up")

    async def run() -> tuple[Any, dict[str, list[int]], Any]:
        async with AsyncKVCoordClient(server.address, timeout=10, retry=POLICY, interceptors=[hold]) as c:
            s = await c.attach("p", "sha256_cbor", 4, "0")
            first = await c.step("p", [allocate("a", list(range(8)), 8)], s.session_id, s.fence)
            assert first.results[0].status_code == 0
            free = asyncio.ensure_future(c.free("p", ["a"], session_id=s.session_id, fence=s.fence))
            await hold.held.wait()
            if how == "cancelled":
                free.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await free
            else:
                with pytest.raises(OutcomeUnknownError):
                    await free
                hold.cut = False
            assert len(given_up.given_up(s.session_id)) == 1
            # outcome unknown: free it (a second Free under a new key), admit it again
            await c.free("p", ["a"], session_id=s.session_id, fence=s.fence)
            assert given_up.given_up(s.session_id) == {}  # (named by an answered call)
            again = await c.step("p", [allocate("a", list(range(8)), 8)], s.session_id, s.fence)
            assert again.results[0].status_code == 0
            late = await hold.release()
            with KVCoordClient(server.address, timeout=10) as check:
                return late, _held(check), again.results[0].allocate

    late, held, again = asyncio.run(run())
    assert held == {"a": _blocks(again)}, f"the late copy of the first Free was applied: {held}, {late!r}"
    assert isinstance(late, grpc.RpcError) and late.code() == grpc.StatusCode.ABORTED, late


def _unkeyed(rpc: str, session: pb.AttachResponse) -> tuple[Any, Any]:
    """``rpc``'s method and a request of it built by its caller, without a key: an
    Allocate or a Step registering "c", a Free of "b"."""
    s = session
    if rpc == "Allocate":
        op = allocate("c", list(range(12)), 12).allocate
        return Api.allocate, pb.AllocateRequest(pool="p", session_id=s.session_id, fence=s.fence, op=op)
    if rpc == "Step":
        ops = [allocate("c", list(range(12)), 12)]
        return Api.step, pb.StepRequest(pool="p", session_id=s.session_id, fence=s.fence, ops=ops)
    return Api.free, pb.FreeRequest(pool="p", session_id=s.session_id, fence=s.fence, request_ids=["b"])


def _told(rpc: str, answer: Any) -> dict[str, list[int]]:
    """What an answer told the caller the pool holds besides "b" (freed: nothing)."""
    if rpc == "Free":
        return {}
    if rpc == "Step" and answer.results[0].status_code:  # (told: "c" was not allocated)
        return {"b": [1, 2]}
    result = answer.result if rpc == "Allocate" else answer.results[0].allocate
    return {"b": [1, 2], "c": _blocks(result)}


@pytest.mark.parametrize("rpc", KEYED)
@pytest.mark.parametrize("kind", ["aio", "blocking"])
def test_a_keyed_request_built_without_a_key_is_applied_once_when_its_answer_is_lost(
    server: InProcessServer, kind: str, rpc: str
) -> None:
    """A caller builds an Allocate, Free or Step itself (for a field the method does not
    take: ``events_digest``, ``abandoned``; the asyncio client has no ``send_step``) and
    sends it through ``unary`` without an idempotency key; its answer is lost after the
    server applied it. The client keys it before its first attempt, so the retry is
    answered from the first, and the caller is told what the pool holds (old code: the
    unkeyed retry was applied as a new call and refused, "already registered" / "not in
    pool": the caller told nothing was applied while "c" held blocks or "b" was freed)."""

    async def run_aio() -> tuple[Any, dict[str, list[int]]]:
        lose = AsyncFaultInjector(0, drop=1.0, methods=(rpc,))
        lose.enabled = False
        lose.on_drop = lambda: setattr(lose, "enabled", False)
        async with AsyncKVCoordClient(server.address, timeout=10, interceptors=[lose]) as c:
            s = await c.attach("p", "sha256_cbor", 4, "0")
            await c.step("p", [allocate("b", list(range(8)), 8)], s.session_id, s.fence)
            method, request = _unkeyed(rpc, s)
            lose.enabled = True  # (the set-up Step passed)
            try:
                told: Any = await c.unary(method, request)
            except Exception as exc:
                told = exc
            assert lose.counts["dropped"] == 1
        with KVCoordClient(server.address, timeout=10) as check:
            return told, _held(check)

    def run_blocking() -> tuple[Any, dict[str, list[int]]]:
        lose = FaultInjector(0, drop=1.0, methods=(rpc,))
        lose.enabled = False
        lose.on_drop = lambda: setattr(lose, "enabled", False)
        with KVCoordClient(server.address, timeout=10, interceptors=[lose], step_stream=False) as c:
            s = c.attach("p", "sha256_cbor", 4, "0")
            c.step("p", [allocate("b", list(range(8)), 8)], s.session_id, s.fence)
            method, request = _unkeyed(rpc, s)
            lose.enabled = True  # (the set-up Step passed)
            try:
                told: Any = c.unary(method, request)
            except Exception as exc:
                told = exc
            assert lose.counts["dropped"] == 1
            return told, _held(c)

    told, held = asyncio.run(run_aio()) if kind == "aio" else run_blocking()
    assert not isinstance(told, Exception), f"told {told!r} while the pool holds {held}"
    assert held == _told(rpc, told), f"told {told} while the pool holds {held}"


async def _worker(c: AsyncKVCoordClient, name: str, rounds: int) -> dict[str, list[int]]:
    """One session on ``c`` (others share the client, concurrently): rounds of one Step
    registering four requests (their prompts shared within the session: cache hits)
    and one Allocate, then a Free of all but the last round's; the block table each
    request was told it holds."""
    s = await c.attach("p", "sha256_cbor", 4, "0", client_name=name)
    told: dict[str, list[int]] = {}
    for k in range(rounds):
        ids = [f"{name}-{k}-{i}" for i in range(4)]
        prompt = [hash((name, j)) % 1000 for j in range(8)]
        ops = [allocate(rid, [*prompt, 1000 + i], 9, return_table=True) for i, rid in enumerate(ids)]
        got = await c.step("p", ops, s.session_id, s.fence)
        for rid, r in zip(ids, got.results, strict=True):
            assert r.status_code == 0 and not r.allocate.refused, r
            told[rid] = list(r.allocate.table[0].block_ids)
        one = allocate(f"{name}-{k}-x", [*prompt, 2000], 9, return_table=True).allocate
        answer = await c.allocate("p", one, s.session_id, s.fence)
        told[f"{name}-{k}-x"] = list(answer.result.table[0].block_ids)
        if k < rounds - 1:
            freed = [*ids, f"{name}-{k}-x"]
            await c.free("p", freed, session_id=s.session_id, fence=s.fence)
            for rid in freed:
                del told[rid]
    return told


def test_concurrent_sessions_on_one_asyncio_client_are_told_the_blocks_they_hold(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Three sessions share one asyncio client, their calls interleaved on its channel
    (asyncio.gather), under lost, late, duplicated and re-delivered answers of every
    keyed call (a late copy goes out with another session's call): every request ends
    holding exactly the blocks its session was told, no block is held twice, and the
    pool's invariants hold."""
    for seed in range(2):
        server = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
        faults = AsyncFaultInjector(seed, drop=0.2, delay=0.1, duplicate=0.15, reorder=0.3, methods=KEYED)

        told = asyncio.run(_workers(server.address, faults))
        with KVCoordClient(server.address, timeout=10) as check:
            held = _held(check)
            assert check.check_pool("p").violations == []
        assert held == told, f"seed {seed}"
        assert _own_blocks_held_once(held), f"seed {seed}: {held}"
        assert faults.counts["dropped"] and faults.counts["reordered"], faults.counts


async def _workers(address: str, faults: AsyncFaultInjector) -> dict[str, list[int]]:
    async with AsyncKVCoordClient(address, timeout=10, interceptors=[faults]) as c:
        tables = await asyncio.gather(*(_worker(c, f"w{j}", 6) for j in range(3)))
    return {rid: t for table in tables for rid, t in table.items()}


def _own_blocks_held_once(held: dict[str, list[int]]) -> bool:
    """A block two tables share is the cached prefix of a session's prompt (its first
    two blocks); a request's own last block (its tokens alone) is in no other table."""
    lasts = [t[-1] for t in held.values()]
    return len(lasts) == len(set(lasts))


@pytest.mark.parametrize("fault", ["drop", "delay", "duplicate"])
def test_an_exclusive_attach_whose_answer_is_lost_is_one_session(server: InProcessServer, fault: str) -> None:
    """An exclusive Attach applied on the server, its answer lost, late or the request
    delivered twice: retried (or answered) under its attach_key, the asyncio client gets
    the session the first made, and the pool has that one session (as the blocking
    client's test_an_attach_whose_answer_was_lost_is_retried_into_the_same_session)."""
    faults = FirstAnswersLost(fault, ["Attach"])

    async def run() -> pb.AttachResponse:
        async with AsyncKVCoordClient(server.address, timeout=10, interceptors=[faults]) as c:
            return await c.attach("p", "sha256_cbor", 4, "0", client_name="engine-0", exclusive=True)

    got = asyncio.run(run())
    assert got.exclusive and faults.counts[{"drop": "dropped", "delay": "delayed"}.get(fault, "duplicated")]
    with KVCoordClient(server.address, timeout=10) as c:
        assert [s.session_id for s in c.list_sessions("p").sessions] == [got.session_id]
        assert c.get_stats("p").num_sessions == 1


class FailPieceOnce(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Step number ``at`` (from 0) fails once before it is sent (INTERNAL: not retried)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.steps = 0

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        if details.method.decode().endswith("/Step"):
            self.steps += 1
            if self.steps == self.at + 1:
                raise LocalRpcError(grpc.StatusCode.INTERNAL, "injected: piece lost")
        return await continuation(details, request)


async def _pieces_run(address: str, interceptors: Sequence[Any], again: bool) -> tuple[Any, Any]:
    """A Step of ten operations (three pieces) through ``unary``, built by the caller
    (``include_state``); with ``again``, its failure is followed by sending the same
    request again. The answer (results and free count) and the error raised first."""
    async with AsyncKVCoordClient(address, timeout=10, interceptors=list(interceptors)) as c:
        s = await c.attach("p", "sha256_cbor", 4, "0")
        request = pb.StepRequest(
            pool="p", session_id=s.session_id, fence=s.fence, ops=_ops(0), include_state=True
        )
        first: Any = None
        try:
            answer = await c.unary(Api.step, request)
        except OutcomeUnknownError as exc:
            first = exc
            assert again
            answer = await c.unary(Api.step, request)  # the same request, its same key
        return [(r.status_code, r.allocate) for r in answer.results], first


def test_a_step_piece_that_fails_and_the_same_request_sent_again_completes_once(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The second of three Step pieces fails (not sent): the asyncio caller is told
    OutcomeUnknownError (the first piece applied), its note naming the piece; sending the
    same request again through ``unary`` (keyed once, by its caller or the client)
    applies the rest once: the answer and the pool equal a calm run's."""
    calm = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
    faulty = make_server(TOML, limits=Limits(max_ops_per_step=CAP))
    want, _ = asyncio.run(_pieces_run(calm.address, [], again=False))
    got, first = asyncio.run(_pieces_run(faulty.address, [FailPieceOnce(1)], again=True))
    assert isinstance(first, OutcomeUnknownError) and "Step piece 2 of 3" in "".join(first.__notes__)
    assert got == want
    with KVCoordClient(calm.address) as a, KVCoordClient(faulty.address) as b:
        assert _state(b) == _state(a) and _stats(b) == _stats(a)
