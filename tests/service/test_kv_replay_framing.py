"""The replay socket of a vllm-0.33 pool's KV event publisher frames its answers as
vLLM 0.33 does from the start, not only once the pool's first batch was published.

(tests/with_vllm/test_kv_events.py checks 0.33's framing against vLLM's own
subscriber once events flow; here the framing before the first batch is compared
with the framing after it, in the same server.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

zmq = pytest.importorskip("zmq")

from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.hashing import block_hasher, none_hash  # noqa: E402
from kvcoord.service.testing import InProcessServer  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

CONFIG = """
[[pools]]
name = "p33"
profile = "vllm-0.33"
num_blocks = 32
hash_block_size = 4
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true
max_model_len = 128

[[pools.groups]]
type = "full"
block_size = 4

[[kv_events]]
pool = "p33"
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"
topic = "kv@p33"
buffer_steps = 100
"""


@pytest.fixture
def server() -> Iterator[InProcessServer]:
    srv = InProcessServer(CONFIG).start()
    yield srv
    srv.stop()


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Every message a replay from ``start`` answers, its end marker last."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[list[bytes]] = []
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        for _ in range(1000):
            assert dealer.poll(10_000), "no replay answer"
            frames = dealer.recv_multipart()
            out.append(frames)
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                return out
        raise AssertionError("no end of the replay")
    finally:
        dealer.close(linger=0)


def test_a_033_pools_replay_is_framed_alike_before_and_after_its_first_batch(server: InProcessServer) -> None:
    publisher = server.running.publishers.publishers["p33"]  # type: ignore[union-attr]
    time.sleep(0.3)  # the follower has seen the pool (and found no event to publish)
    before = _replay(publisher.replay_endpoint, 0)
    assert len(before) == 1  # nothing published yet: the end marker alone

    with KVCoordClient(server.address, timeout=10) as client:
        cfg = client.get_pool("p33").pool.config
        r = client.attach("p33", cfg.hash_algo, cfg.hash_block_size, cfg.hash_seed, profile="vllm-0.33")
        prompt = list(range(17))
        hasher = block_hasher(
            "vllm-0.33", cfg.hash_algo, cfg.hash_block_size,
            none_hash(cfg.hash_algo, cfg.hash_seed, profile="vllm-0.33"),
        )  # fmt: skip
        sync = pb.RequestSync(
            request_id="r0",
            append_token_ids=prompt,
            append_block_hashes=hasher.extend(prompt),
            new_request=True,
        )
        op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=len(prompt), lookup=True))
        client.step("p33", [op], r.session_id, fence=r.fence)
    for _ in range(100):  # until the stored blocks' batch is published
        if publisher.events_sent:
            break
        time.sleep(0.05)
    assert publisher.events_sent
    after = _replay(publisher.replay_endpoint, 0)
    assert len(after) >= 2  # the batch, then the end marker
    # the same end marker (the same number of frames) as once events were published
    assert before[-1] == after[-1]
