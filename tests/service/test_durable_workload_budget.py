"""The chaos run's worker (tests/durable_workload.py) once sent an allocation of 0 tokens
(``InvalidArgumentError: num_new_tokens must be > 0 unless num_external_computed_tokens
is > 0``, from ``RemoteKVCacheManager.allocate_slots``) after its requests were lost.

Not the manager: the worker's step. A request that finishes (its last token computed,
``decode_left`` 0) is freed and the loop goes on to the next request with ``continue``,
skipping the loop's ``budget <= 0`` check; when that request used up exactly what was
left of the step's 256 tokens, the next request was scheduled ``min(remaining, 0)``
tokens. tests/workload.py's worker has the check at the loop's top since; this one did
not. A loss makes it likely: every lost request is admitted again with its whole prompt
(256-token chunks), a request lost after its last decode token among them.

Reproduced over real gRPC with that loss: A (255 prompt tokens, one to decode) and B
(40 tokens) are admitted; A's last token is appended (``decode_left`` 0, 256 tokens);
the session is ended under the worker (another client's Detach: the server voided it, as
a restore does); the worker is told both are lost and drops them as its loop does; the
next step admits A again, 256 tokens with no hit (the ended session's cache entries went
with it), which finishes it with the budget spent. Before: B was then allocated 0
tokens. Now B waits for the next step, which admits it; every table checked.

The manager is not at fault: a call failed with UnavailableError in the middle of a
step (the one before it in the step answered) leaves its request as if the call never
happened (the tracker rolled back), so the worker's next steps send it again and every
table the worker holds is the server's (the second test)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from durable_workload import _Holdings, _one_step, drop_lost
from kvcoord.client import KVCoordClient, RemoteKVCacheManager, RequestsLostError, UnavailableError
from kvcoord.client.errors import LocalRpcError
from kvcoord.client.retry import RetryPolicy
from kvcoord.service.testing import InProcessServer
from workload import Req, pool_config


class NoNewRequests(random.Random):
    """The step's generator, but the step admits no new request of its own."""

    def random(self) -> float:
        return 0.99


def test_a_request_finishing_on_the_last_token_of_the_budget_ends_the_step(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server("")
    with KVCoordClient(server.address, timeout=10) as c, KVCoordClient(server.address, timeout=10) as admin:
        c.create_pool("chaos", pool_config(300))
        m = RemoteKVCacheManager(c, "chaos", hash_seed="0", client_name="chaos-0")
        a = Req("a", [random.Random(1).randrange(30000) for _ in range(255)], decode_left=1)
        b = Req("b", [random.Random(2).randrange(30000) for _ in range(40)], decode_left=5)
        live: list[Req] = [a, b]
        running: list[Req] = []
        tables: dict[str, list[list[int]]] = {}
        summary: dict[str, Any] = {"allocs": 0, "checks": 0, "double": []}
        rnd, held = NoNewRequests(7), _Holdings(None, 0)

        def step() -> None:
            _one_step(m, rnd, [], 0, 1, live, running, tables, summary, held)

        step()  # A's prompt (255 tokens) and its first token appended, 1 token of B
        assert (a.num_computed_tokens, len(a.all_token_ids), a.decode_left) == (255, 256, 0)
        assert b.num_computed_tokens == 1 and running == [a, b]

        admin.detach(m.session_id, m.keeper.fence)  # the session ended under the worker
        with pytest.raises(RequestsLostError) as lost:
            step()
        assert sorted(lost.value.request_ids) == ["a", "b"]
        drop_lost(live, running, tables, set(lost.value.request_ids))  # (the worker's forget)

        step()  # A again: 256 tokens, no hit, the whole budget; it finishes
        assert live == [b] and not b.running and b.num_computed_tokens == 0
        assert [r.request_id for r in c.inspect_pool("chaos", all_requests=True).requests] == []
        step()  # B's turn
        assert b.running and b.num_computed_tokens == 40
        assert summary["checks"] == 3 and not summary["double"]  # (a and b, then b)
        assert not admin.check_pool("chaos").violations
        m.close()


class DownFromStep(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Once armed, lets ``skip`` Steps through, then fails every Step as gRPC does when
    no connection can be made (never sent) until disarmed."""

    def __init__(self) -> None:
        self.skip: int | None = None
        self.failed = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if self.skip is not None and details.method.endswith("/Step"):
            if self.skip == 0:
                self.failed += 1
                raise LocalRpcError(
                    grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses (injected)"
                )
            self.skip -= 1
        return continuation(details, request)


def test_an_unavailable_error_in_the_middle_of_a_step_leaves_the_worker_and_the_manager_in_step(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server("")
    down = DownFromStep()
    quick = RetryPolicy(initial_backoff=0.001, max_backoff=0.002, deadline=5.0, max_attempts=2)
    with (
        KVCoordClient(server.address, timeout=10, retry=quick, step_stream=False, interceptors=[down]) as c,
        KVCoordClient(server.address, timeout=10) as admin,
    ):
        c.create_pool("chaos", pool_config(300))
        m = RemoteKVCacheManager(c, "chaos", hash_seed="0", client_name="chaos-0")
        a = Req("a", [random.Random(1).randrange(30000) for _ in range(100)], decode_left=8)
        b = Req("b", [random.Random(2).randrange(30000) for _ in range(40)], decode_left=8)
        live: list[Req] = [a, b]
        running: list[Req] = []
        tables: dict[str, list[list[int]]] = {}
        summary: dict[str, Any] = {"allocs": 0, "checks": 0, "double": []}
        rnd, held = NoNewRequests(7), _Holdings(None, 0)

        def step() -> None:
            _one_step(m, rnd, [], 0, 1, live, running, tables, summary, held)

        step()  # both admitted, their first decode token appended
        assert (a.num_computed_tokens, b.num_computed_tokens) == (100, 40)
        down.skip = 1  # A's decode answered, B's never sent
        with pytest.raises(UnavailableError):
            step()
        assert down.failed == 2  # (both attempts of B's Step)
        assert (a.num_computed_tokens, b.num_computed_tokens) == (101, 40)
        down.skip = None
        for _ in range(3):  # every table checked against the server's after each step
            step()
        assert (a.num_computed_tokens, b.num_computed_tokens) == (104, 43)
        assert summary["checks"] == 8 and not summary["double"]  # (2 a step, none in the failed one)
        assert live == running == [a, b]
        assert not admin.check_pool("chaos").violations
        m.close()
