"""A DecodeOp's appended tokens are bounded by max_tokens_per_request before any column
is read (a real server over real gRPC).

One entry appending ~3.9M tokens fits a 16 MB message; its column was read whole
(unpacked into a list) on the event loop and only then refused for exceeding the
pool's max_model_len: the loop was held 220-900 ms. Refused by its length now, the
loop is held a few ms at most; the bound, 100 ms, is far above that and well below
the stall."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pbg
from kvcoord.wire.columns import pack_uint32
from loop_monitor import LoopMonitor
from support import pool_toml

#: tokens one entry appends: past max_tokens_per_request (1M), the message under 16 MB
N = 3_900_000
MAX_STALL = 0.1


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
        monitor = LoopMonitor(server)
        time.sleep(0.1)
        monitor.reset()
        refused: grpc.RpcError | None = None
        try:
            stub.Step(request, timeout=60)  # (was: read whole, then the entry refused)
        except grpc.RpcError as exc:
            refused = exc
        time.sleep(0.05)
        stall = monitor.stop()
        assert stall < MAX_STALL, f"one DecodeOp held the event loop {stall * 1000:.0f} ms"
        assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = "packed_append_token_ids" if packed else "append_token_ids"
        assert f"decode.{field} is" in (refused.details() or ""), refused.details()
        assert "max_tokens_per_request" in (refused.details() or "")
