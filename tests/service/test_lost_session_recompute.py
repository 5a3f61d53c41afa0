"""A RemoteKVCacheManager that gave up on its lease (LeaseExpiredError: no renewal
answered for 0.95 x the lease, as across a server restart slower than that) reports
every request lost, "recompute them", and starts a new session (``start_again``:
Detach of the old one, its error swallowed, then Attach). When that Detach fails (a
transport error right after the outage) while the Attach succeeds, the old session
still lives on the server, holding the lost requests under their ids; the scheduler's
recompute of them (same request ids, as vLLM does) is then refused PERMISSION_DENIED
"request ... belongs to another session" until the old lease runs out there: an
untyped error after a typed loss that promised the next call works.

Seen in test_chaos_full_disks_a_crash_loop_in_a_grace_and_a_restored_volume at load 18
(a worker ended "PermissionDeniedError: PERMISSION_DENIED: request 'w0-4' belongs to
another session of pool 'chaos'" right after its LeaseExpiredError). Over real gRPC: an
in-process server whose session clock stands still (its lease of the old session never
runs out), a channel interceptor failing Heartbeat and Detach without reaching it.

Fixed: a shared session's ``start_again`` attaches only after a Detach the server
answered (ended, or gone already); one that did not reach it fails the new session
(UnavailableError: the next call tries again, Detach first; an exclusive one is kept out
by the server instead: tests/service/test_predicted_detach_failed.py). Fails on the old
code with PermissionDeniedError "request 'r1' belongs to another session of pool 'p'"."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, RemoteKVCacheManager, RequestsLostError
from kvcoord.client.errors import LeaseExpiredError, LocalRpcError
from kvcoord.service.testing import InProcessServer
from support import Req, pool_toml

LEASE = 1.0


class Partition(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Calls of the methods in ``cut`` fail UNAVAILABLE without reaching the server."""

    def __init__(self) -> None:
        self.cut: tuple[str, ...] = ()

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if details.method.rsplit("/", 1)[-1] in self.cut:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: partitioned")
        return continuation(details, request)


def _allocate(m: RemoteKVCacheManager, r: Req) -> list[int]:
    hit, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, len(r.all_token_ids) - n, n, hit)
    assert new is not None
    return list(new.get_block_ids()[0])


def test_requests_lost_to_an_unproven_lease_can_be_recomputed_under_their_ids(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server(pool_toml("p", 64))  # (its session clock is a ManualClock: no lease ends)
    net = Partition()
    with KVCoordClient(server.address, timeout=20, interceptors=[net]) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", client_name="w", lease_seconds=LEASE, renew=False)
        r1 = Req("r1", list(range(32)))
        _allocate(m, r1)
        net.cut = ("Heartbeat", "Detach")
        time.sleep(LEASE)  # past 0.95 x the lease, the renewal fails: the proof broke
        with pytest.raises(RequestsLostError) as lost:
            _allocate(m, Req("r2", list(range(100, 132))))
        assert isinstance(lost.value.cause, LeaseExpiredError)
        assert sorted(lost.value.request_ids) == ["r1", "r2"]
        net.cut = ()
        r1.num_computed_tokens = 0
        assert _allocate(m, r1)  # the recompute the loss asked for (was: PERMISSION_DENIED)
        held = {r.request_id for r in c.inspect_pool("p", all_requests=True).requests}
        assert held == {"r1"}
        m.close()
