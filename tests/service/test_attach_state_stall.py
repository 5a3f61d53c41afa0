"""An exclusive Attach asking for the one-group pool state (want_pool_state without
want_engine_state: clients before the mirror) does not hold the event loop (a real
server over real gRPC).

That state (every cached block's hash) is built on the event loop; it was built twice
(the size check, then the answer): 300,000 free cached blocks held the loop ~470 ms
in review (340-520 ms here). It is built once now, and only for a pool that has built
fewer than FORK_BLOCKS blocks (about 25 ms at most); a larger pool refuses it with
ANSWER_TOO_LARGE naming want_engine_state (whose export is made off the loop), before
any session exists. The bound, 100 ms, is well above the refusal's few ms and well
below the stall."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from kvcoord.client import KVCoordClient, ResourceExhaustedError
from kvcoord.service.state_export import FORK_BLOCKS
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from loop_monitor import LoopMonitor
from service.helpers import hashes
from support import pool_toml

BLOCKS = 300_000
#: blocks of each request that fills the pool (4 tokens each)
PER_REQUEST = 64
MAX_STALL = 0.1


def test_a_large_pools_one_group_state_is_refused_unbuilt(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server(pool_toml("big", BLOCKS + 8).replace("max_model_len = 256", "max_model_len = 4096"))
    with KVCoordClient(server.address, timeout=120) as client:
        r = client.attach("big", "sha256_cbor", 4, "0", lease_seconds=60)
        base = 0
        requests = BLOCKS // PER_REQUEST
        for k in range(0, requests, 256):
            ops = []
            for i in range(k, min(requests, k + 256)):
                tokens = list(range(base, base + PER_REQUEST * 4))
                base += PER_REQUEST * 4
                sync = pb.RequestSync(
                    request_id=f"r{i}",
                    append_token_ids=tokens,
                    append_block_hashes=hashes(tokens),
                    new_request=True,
                )
                ops.append(pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=len(tokens))))
            assert not any(x.status_code for x in client.step("big", ops, r.session_id, r.fence).results)
        client.detach(r.session_id, r.fence)  # every block free and cached
        monitor = LoopMonitor(server)
        time.sleep(0.1)
        monitor.reset()
        refused: ResourceExhaustedError | None = None
        try:
            client.attach("big", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True)
        except ResourceExhaustedError as exc:
            refused = exc
        stall = monitor.stop()
        assert stall < MAX_STALL, f"one Attach held the event loop {stall * 1000:.0f} ms"
        assert refused is not None and refused.reason == "ANSWER_TOO_LARGE"
        assert "want_engine_state" in str(refused) and f"{FORK_BLOCKS:,}" in str(refused)
        # no session was made: an exclusive one may attach
        assert client.attach("big", "sha256_cbor", 4, "0", exclusive=True).exclusive


@pytest.mark.parametrize("exclusive", [True, False])
def test_a_small_pools_one_group_state_is_still_given(
    make_server: Callable[..., InProcessServer], exclusive: bool
) -> None:
    server = make_server(pool_toml("small", 64))
    with KVCoordClient(server.address, timeout=30) as client:
        a = client.attach("small", "sha256_cbor", 4, "0", exclusive=exclusive, want_pool_state=True)
        if exclusive:
            assert a.HasField("pool_state") and a.pool_state.next_fresh >= 1
        else:
            assert a.pool_state_unavailable == "the session is not exclusive"
