"""What the tests of late copies of keyed calls share (test_late_*.py): a server whose
idempotency window is as short as its lease allows, a raw send (no client library, no
retry), the refusal a late copy must meet, and the pool's block tables."""

from __future__ import annotations

from typing import Any

import grpc
from kvcoord.client import KVCoordClient
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

#: the shortest window the config accepts for this lease (twice the longest lease)
LEASE = 10.0
WINDOW = 2 * LEASE
SETTINGS: dict[str, Any] = {
    "session_lease_seconds": LEASE,
    "max_session_lease_seconds": LEASE,
    "idempotency_window_seconds": WINDOW,
    # a 10 s lease outlasts a stall of 8 s and its 1 s allowance in the 95 % a client
    # trusts (the 10 s default bound is refused with it on a durable server)
    "journal_stall_seconds": 8.0,
}
PROMPT = list(range(1, 9))  # two full blocks of 4 tokens


def send_raw(address: str, rpc: str, request: Any) -> Any:
    """``request`` sent once as it is (no client library, no retry): its answer."""
    with grpc.insecure_channel(address) as channel:
        return getattr(pb_grpc.AllocatorStub(channel), rpc)(request, timeout=10)


def assert_refused(err: grpc.RpcError | None, code: grpc.StatusCode, reason: str) -> None:
    """``err`` (None: the call was applied) is ``code`` with kvcoord's ``reason``."""
    assert err is not None, "the late delivery was applied"
    what = f"{err.code()} {err.details()}"
    assert err.code() == code, what
    assert ("kvcoord-reason", reason) in (err.trailing_metadata() or ()), what


def tables(client: KVCoordClient, pool: str = "p") -> dict[str, list[int]]:
    """Every request the pool holds: its first group's block ids."""
    return {
        r.request_id: list(r.groups[0].block_ids)
        for r in client.inspect_pool(pool, all_requests=True).requests
    }
