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


def _call(access: AccessControl, context: _Context) -> tuple[Any, list[Tenant]]:
    seen: list[Tenant] = []

    async def handler(_request: Any, _context: Any) -> str:
        seen.append(current_tenant())
        return "answer"

    async def pools_free(_request: Any) -> None:
        return None

    guarded = guard(handler, False, "GetStats", access, lambda: None, Limits(), pools_free)
    return asyncio.run(guarded(pb.GetStatsRequest(pool="p"), context)), seen


def _access(tokens: tuple[str, ...]) -> AccessControl:
    return AccessControl((), tokens, SessionTable(time.monotonic, 30.0, 300.0))


def test_a_server_without_credentials_reads_no_metadata() -> None:
    """Every caller has full access there: reading the call's metadata (2 µs of gRPC's
    per call) could change nothing, even a token the server does not know."""
    context = _Context((("authorization", "Bearer unknown"),))
    answer, seen = _call(_access(()), context)
    assert (answer, seen, context.reads) == ("answer", [FULL_ACCESS], 0)


def test_a_server_with_tokens_reads_and_checks_them() -> None:
    context = _Context((("authorization", "Bearer unknown"),))
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        _call(_access(("good",)), context)
    answer, seen = _call(_access(("good",)), _Context((("authorization", "Bearer good"),)))
    assert answer == "answer" and seen[0].full_access
