"""The guard every Allocator handler runs behind (rpc_guard.guard): what it reads of a call."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from kvcoord.service.access import FULL_ACCESS, AccessControl, Tenant, current_tenant
from kvcoord.service.pool_service import Limits
from kvcoord.service.rpc_guard import guard
from kvcoord.service.sessions import SessionTable
from kvcoord.v1 import allocator_pb2 as pb


class _Context:
    """What the guard reads of a call's context, counting the metadata reads."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata
        self.reads = 0

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        self.reads += 1
        return self.metadata

    def auth_context(self) -> dict[str, Any]:
        return {}

    async def abort(self, code: grpc.StatusCode, message: str, trailers: Any = ()) -> None:
        raise RuntimeError(code.name)


def _call(access: AccessControl, context: _Context, me: str = "") -> tuple[Any, list[Tenant]]:
    seen: list[Tenant] = []

    async def handler(_request: Any, _context: Any) -> str:
        seen.append(current_tenant())
        return "answer"

    async def pools_free(_request: Any) -> None:
        return None

    guarded = guard(handler, False, "GetStats", access, lambda: None, Limits(), pools_free, lambda: me)
    return asyncio.run(guarded(pb.GetStatsRequest(pool="p"), context)), seen


def _access(tokens: tuple[str, ...]) -> AccessControl:
    return AccessControl((), tokens, SessionTable(time.monotonic, 30.0, 300.0))


def test_a_server_without_credentials_reads_the_metadata_once_for_the_replica_named() -> None:
    """Every caller has full access there, even with a token the server does not know;
    the metadata is read once all the same (2 µs of gRPC's per call; was: never read), for
    the replica a call names (``kvcoord-replica``), which any server checks."""
    context = _Context((("authorization", "Bearer unknown"),))
    answer, seen = _call(_access(()), context)
    assert (answer, seen, context.reads) == ("answer", [FULL_ACCESS], 1)


def test_a_server_with_tokens_reads_and_checks_them() -> None:
    context = _Context((("authorization", "Bearer unknown"),))
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        _call(_access(("good",)), context)
    good = _Context((("authorization", "Bearer good"),))
    answer, seen = _call(_access(("good",)), good)
    assert answer == "answer" and seen[0].full_access and good.reads == 1  # (read once for both)


@pytest.mark.parametrize("me", ["", "k/r1", "other/r2"])
def test_a_call_naming_another_replica_is_refused_before_its_handler_runs(me: str) -> None:
    """WRONG_REPLICA (UNAVAILABLE) for a call naming a replica this server is not (a
    single node, another replica, another cluster's), before its token or its request
    is looked at; one naming this server is served."""
    named = (("kvcoord-replica", "k/r2"), ("authorization", "Bearer good"))
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        _call(_access(("good",)), _Context(named), me)
    answer, _ = _call(_access(("good",)), _Context(named), "k/r2")
    assert answer == "answer"
