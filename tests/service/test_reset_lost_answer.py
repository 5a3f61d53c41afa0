"""The exclusive session's own prefix-cache reset (its Step's ResetPrefixCacheOp: what
both managers send for vLLM's reset_prefix_cache) whose answer is lost, duplicated or
delivered again late, over real gRPC (a channel interceptor faults that very Step):
it is keyed as any Step, so it resets once. A second reset applied late, once another
prompt's blocks are cached and free again, would forget them: the continuation below
would then miss where vLLM hits, and the mirror would differ from the server. Compared
with a fault-free run: same block ids, same hits, same whole pool state (and the
predicting client's mirror equal to it). The ResetPrefixCache RPC naming the session
is never retried: a lost answer is a typed OutcomeUnknownError, applied once."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import LocalRpcError, OutcomeUnknownError
from kvcoord.client.faults import FaultInjector
from kvcoord.engine.state import export_state
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.test_grown_prompt_lost_answer import _config, _manager, _request
from service.test_predicted_mirror_state import comparable

A = list(range(100, 112))  # 12 tokens: 3 full blocks
B = list(range(200, 212))


def _resets(msg: Any) -> bool:
    return any(op.WhichOneof("op") == "reset_prefix_cache" for op in getattr(msg, "ops", ()))


def _names(msg: Any, rid: str) -> bool:
    """Whether a message names request ``rid`` anywhere."""
    for field, value in msg.ListFields():
        if field.name == "request_id" and value == rid:
            return True
        if field.message_type is not None:
            for v in [value] if hasattr(value, "DESCRIPTOR") else value:
                if _names(v, rid):
                    return True
    return False


class FaultResetStep(FaultInjector):
    """Faults the Step that resets the cache: "drop" (applied, its answer lost),
    "duplicate" (applied twice at once), "reorder" (answered, then delivered again late:
    just before the Step that allocates request "q", once B's blocks are cached and free)."""

    def __init__(self, fault: str) -> None:
        super().__init__(0, methods=("Step",))
        self.fault = fault
        self.seen: list[pb.StepRequest] = []

    def _draw(self, item: Any, held: list[Any]) -> tuple[str, Any]:
        request = item[1] if isinstance(item, tuple) else item
        self.counts["calls"] += 1
        if _resets(request):
            self.seen.append(request)
            if len(self.seen) == 1:
                if self.fault == "reorder":
                    held.append(item)
                    return "none", None
                return self.fault, None
            return "none", None
        if held and _names(request, "q"):
            self.counts["reordered"] += 1
            return "none", held.pop(0)
        return "none", None


def _run(m: Any) -> tuple[bool, list[Any], int]:
    """A's blocks cached and freed; the cache reset (the faulted Step); B's computed and
    freed; "q" continuing B looked up and allocated. Returns the reset's answer, the
    block ids handed out and q's hit (tokens)."""
    tables = []
    a = _request("a", A)
    hit, n = m.get_computed_blocks(a)
    assert m.allocate_slots(a, 12, n, hit) is not None
    a.num_computed_tokens = 12
    tables.append(m.get_block_ids("a"))
    m.take_events()
    m.free(a)
    m.take_events()
    done = m.reset_prefix_cache()
    m.take_events()
    m.flush()
    b = _request("b", B)
    hit, n = m.get_computed_blocks(b)
    assert n == 0
    assert m.allocate_slots(b, 12, n, hit) is not None
    b.num_computed_tokens = 12
    tables.append(m.get_block_ids("b"))
    m.take_events()
    m.flush()
    m.free(b)
    m.take_events()
    m.flush()
    q = _request("q", [*B, 1, 2, 3, 4, 5])
    hit, n = m.get_computed_blocks(q)
    assert m.allocate_slots(q, 17 - n, n, hit) is not None
    tables.append(m.get_block_ids("q"))
    m.take_events()
    m.flush()
    return done, tables, n


@pytest.mark.parametrize("fault", ["drop", "duplicate", "reorder"])
@pytest.mark.parametrize("mode", ["predicted", "waiting"])
def test_the_exclusive_sessions_reset_faulted_resets_once(
    server: InProcessServer, mode: str, fault: str
) -> None:
    faults = FaultResetStep(fault)
    with (
        KVCoordClient(server.address, timeout=10) as clean_client,
        KVCoordClient(server.address, timeout=10, interceptors=[faults]) as c,
    ):
        ref = _manager(mode, clean_client, "clean")
        want = _run(ref)
        assert want[0] is True and want[2] == 8, want  # reset done; q hits B (a late reset: 0)
        m = _manager(mode, c, "faulted")
        got = _run(m)
        kind = {"drop": "dropped", "duplicate": "duplicated", "reorder": "reordered"}[fault]
        assert faults.counts[kind] == 1, faults.counts
        if fault == "drop":  # retried under its key
            assert (
                len(faults.seen) == 2 and faults.seen[0] == faults.seen[1] and faults.seen[0].idempotency_key
            )
        assert got == want
        pools = server.running.servicer.registry.pools  # type: ignore[union-attr]
        engine = pools["faulted"].engine
        assert comparable(export_state(engine)) == comparable(export_state(pools["clean"].engine))
        if mode == "predicted":
            assert comparable(export_state(m.mirror.engine)) == comparable(export_state(engine))
        m.close()
        ref.close()


class LoseResetAnswer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Every ResetPrefixCache call reaches the server and is applied; its answer is lost."""

    def __init__(self) -> None:
        self.sent = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if isinstance(request, pb.ResetPrefixCacheRequest):
            self.sent += 1
            continuation(details, request).result()
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: connection lost before the answer")
        return continuation(details, request)


def test_the_reset_rpc_of_the_exclusive_session_whose_answer_is_lost_is_not_retried(
    server: InProcessServer,
) -> None:
    lose = LoseResetAnswer()
    with KVCoordClient(server.address, timeout=10, interceptors=[lose]) as c:
        c.create_pool("rpc", _config())
        s = c.attach("rpc", "sha256_cbor", 4, "0", "worker", exclusive=True, profile="vllm-0.33")
        with pytest.raises(OutcomeUnknownError):
            c.reset_prefix_cache("rpc", s.session_id, s.fence)
        assert lose.sent == 1  # never sent twice
        assert c.get_stats("rpc").prefix_cache_stats is not None
