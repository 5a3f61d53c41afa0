"""A keyed call whose client deadline runs out while the server waits for its record to
be durable (the journal's commit held, as on a slow disk): the call is applied, its
answer lost (DEADLINE_EXCEEDED). Its retry under the same key gets the answer the
first call made, byte for byte, and nothing is applied twice: the answer is kept under
its key before the commit wait, and a cancelled wait leaves it there.

A real server over real gRPC; the journal's writes held on its writer thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from support import pool_toml


def _request(rpc: str, s: Any) -> Any:
    op = allocate("r1", list(range(8)), 8)
    if rpc == "Allocate":
        return pb.AllocateRequest(
            pool="p",
            session_id=s.session_id,
            fence=s.fence,
            op=op.allocate,
            idempotency_key="k-1",
            call_sequence=1,
        )
    return pb.StepRequest(
        pool="p", session_id=s.session_id, fence=s.fence, ops=[op], idempotency_key="k-1", call_sequence=1
    )


def _blocks(rpc: str, answer: Any) -> list[int]:
    result = answer.result if rpc == "Allocate" else answer.results[0].allocate
    return list(result.new_block_ids[0].block_ids)


@pytest.mark.parametrize("rpc", ["Allocate", "Step"])
def test_a_keyed_call_whose_deadline_ends_in_the_commit_wait_is_applied_once(
    make_server: Callable[..., InProcessServer], tmp_path: Path, rpc: str
) -> None:
    server = make_server(pool_toml("p", 32), data_dir=str(tmp_path / "data"))
    assert server.running is not None
    store = server.running.servicer.registry.recorder.journal.store  # type: ignore[attr-defined]
    release = threading.Event()
    real_write = store.write

    def slow_write(*args: Any, **kw: Any) -> Any:  # a slow disk (on the journal's thread)
        release.wait(20)
        return real_write(*args, **kw)

    with KVCoordClient(server.address, retry=NO_RETRY) as c:
        s = c.attach("p", "sha256_cbor", 4, "0", lease_seconds=60)
        free = c.get_stats("p").num_free_blocks
        request = _request(rpc, s)
        call = getattr(c.stub, rpc)
        store.write = slow_write
        try:
            with pytest.raises(grpc.RpcError) as lost:
                call(request, timeout=0.5)  # applied; its answer waits for the held commit
            assert lost.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            release.set()
        again = call(request, timeout=10)  # the retry: the first call's answer
        once_more = call(request, timeout=10)
        assert again.SerializeToString() == once_more.SerializeToString()
        given = _blocks(rpc, again)
        assert len(given) == 2
        stats = c.get_stats("p")
        assert (stats.num_free_blocks, stats.num_requests) == (free - 2, 1)  # applied once
        held = c.inspect_pool("p", all_requests=True).requests
        assert [(r.request_id, list(r.groups[0].block_ids)) for r in held] == [("r1", given)]
