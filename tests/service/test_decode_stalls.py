"""A DecodeOp does not hold the event loop (a real server over real gRPC).

One entry appending ~3.9M tokens fits a 16 MB message; its column was read whole
(unpacked into a list) on the event loop and only then refused for exceeding the
pool's max_model_len: the loop was held 220-900 ms. Its appended tokens are bounded by
max_tokens_per_request now, refused before any column is read: the loop is held a few
ms at most. A well-formed decode step of 65,536 entries (max_ops_per_step) was applied
in one engine call (222-232 ms in review, 380 ms here); its columns are read and it is
applied in slices now (long_syncs.decode_in_slices, PoolAllocations.decoding): 20-27 ms
measured, the client in this process holding the interpreter too. The bound, 100 ms,
is well above what is left and well below the stalls."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pbg
from kvcoord.wire.columns import pack_uint32
from loop_monitor import LoopMonitor
from support import pool_toml

#: tokens one entry appends: past max_tokens_per_request (1M), the message under 16 MB
N = 3_900_000
MAX_STALL = 0.1


def _step_of_bytes(channel: grpc.Channel) -> Callable[..., pb.StepResponse]:
    """Step sending a request serialized already: serializing millions of values in
    this process (the server's too) would hold the interpreter, counted as a stall."""
    return channel.unary_unary(
        "/kvcoord.v1.Allocator/Step",
        request_serializer=lambda b: b,
        response_deserializer=pb.StepResponse.FromString,
    )


def _decode(packed: bool) -> pb.Operation:
    cols = {
        "base_num_tokens": [4], "base_num_hashes": [1], "num_computed_tokens": [4], "num_new_tokens": [1],
        "num_lookahead_tokens": [0], "num_append_tokens": [N], "num_append_hashes": [0],
    }  # fmt: skip
    if packed:
        d = pb.DecodeOp(
            request_ids=["a"],
            packed_append_token_ids=pack_uint32(range(N)),
            **{f"packed_{k}": pack_uint32(v) for k, v in cols.items()},  # type: ignore[arg-type]
        )
    else:
        d = pb.DecodeOp(request_ids=["a"], append_token_ids=range(N), **cols)  # type: ignore[arg-type]
    return pb.Operation(decode=d)


@pytest.mark.parametrize("packed", [True, False])
def test_a_decode_op_past_max_tokens_is_refused_unread(
    make_server: Callable[..., InProcessServer], packed: bool
) -> None:
    server = make_server(pool_toml("p", 64))
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(server.address, options=opts) as channel:
        stub = pbg.AllocatorStub(channel)
        a = stub.Attach(pb.AttachRequest(pool="p", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"))
        request = pb.StepRequest(pool="p", session_id=a.session_id, fence=a.fence, ops=[_decode(packed)])
        assert request.ByteSize() < 16 << 20  # (the default max_message_bytes)
        body = request.SerializeToString()
        monitor = LoopMonitor(server)
        time.sleep(0.1)
        monitor.reset()
        refused: grpc.RpcError | None = None
        try:
            _step_of_bytes(channel)(body, timeout=60)  # (was: read whole, then the entry refused)
        except grpc.RpcError as exc:
            refused = exc
        time.sleep(0.05)
        stall = monitor.stop()
        assert stall < MAX_STALL, f"one DecodeOp held the event loop {stall * 1000:.0f} ms"
        assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = "packed_append_token_ids" if packed else "append_token_ids"
        assert f"decode.{field} is" in (refused.details() or ""), refused.details()
        assert "max_tokens_per_request" in (refused.details() or "")


#: entries of the wide decode step: max_ops_per_step, the bound on DecodeOp.request_ids
ENTRIES = 65_536


def test_a_wide_decode_op_is_applied_in_slices(make_server: Callable[..., InProcessServer]) -> None:
    """Each of ENTRIES requests of 4 tokens (one block) decodes its 5th token, taking
    a new block: every entry applied, each block taken once, the pool's invariants kept."""
    blocks = 2 * ENTRIES + 8
    server = make_server(pool_toml("p", blocks, caching=False))
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(server.address, options=opts) as channel:
        stub = pbg.AllocatorStub(channel)
        a = stub.Attach(pb.AttachRequest(pool="p", hash_block_size=4))
        for k in range(0, ENTRIES, 8192):
            ops = [
                pb.Operation(
                    allocate=pb.AllocateOp(
                        request=pb.RequestSync(
                            request_id=f"r{i}", new_request=True, append_token_ids=[i, 1, 2, 3]
                        ),
                        num_new_tokens=4,
                    )
                )
                for i in range(k, k + 8192)
            ]
            r = stub.Step(
                pb.StepRequest(pool="p", session_id=a.session_id, fence=a.fence, ops=ops), timeout=120
            )
            assert not any(x.status_code for x in r.results)
        n = ENTRIES
        d = pb.DecodeOp(
            request_ids=[f"r{i}" for i in range(n)], packed_base_num_tokens=pack_uint32([4] * n),
            packed_base_num_hashes=pack_uint32([0] * n), packed_num_computed_tokens=pack_uint32([4] * n),
            packed_num_new_tokens=pack_uint32([1] * n), packed_num_lookahead_tokens=pack_uint32([0] * n),
            packed_num_append_tokens=pack_uint32([1] * n), packed_append_token_ids=pack_uint32([4] * n),
            packed_num_append_hashes=pack_uint32([0] * n),
        )  # fmt: skip
        request = pb.StepRequest(
            pool="p", session_id=a.session_id, fence=a.fence, ops=[pb.Operation(decode=d)]
        )
        body = request.SerializeToString()
        monitor = LoopMonitor(server)
        time.sleep(0.1)
        monitor.reset()
        answer = _step_of_bytes(channel)(body, timeout=120)
        time.sleep(0.05)
        stall = monitor.stop()
        assert stall < MAX_STALL, f"one well-formed DecodeOp held the event loop {stall * 1000:.0f} ms"
        result = answer.results[0]
        assert result.status_code == 0 and result.decode.num_applied == n and not result.decode.refused
        assert list(result.decode.num_new_blocks) == [1] * n
        assert len(set(result.decode.new_block_ids)) == n  # each block taken once
    with KVCoordClient(server.address, timeout=60) as client:
        assert list(client.check_pool("p").violations) == []
        info = next(p for p in client.list_pools().pools if p.name == "p")
        assert (info.num_free_blocks, info.num_requests) == (blocks - 1 - 2 * n, n)
