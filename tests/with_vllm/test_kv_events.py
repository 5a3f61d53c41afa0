"""A pool's KV events on ZMQ in vLLM 0.16.0's own wire format, decoded with vLLM's own
classes: a subscriber's index equals the pool's prefix-cache map after every step,
also after it drops its connection and replays what it missed; a subscriber that reads
nothing never holds up the pool."""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from durable_server import DurableServer, free_port
from kvcoord.client import KVCoordClient
from kvcoord.engine.events import BlockRemoved, BlockStored, hash_to_int64
from kvcoord.service.kv_publisher import encode_batch
from kvcoord.service.testing import InProcessServer
from support import PoolWorker
from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
from vllm.distributed.kv_events import BlockStored as VllmStored
from vllm.distributed.kv_events import KVEventBatch

CONFIG = """
[[pools]]
name = "hy"
num_blocks = 48
hash_block_size = 4
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true
max_model_len = 256

[[pools.groups]]
type = "full"
block_size = 4

[[pools.groups]]
type = "sliding_window"
block_size = 8
sliding_window = 16

[[kv_events]]
pool = "hy"
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"
topic = "kv@hy"
buffer_steps = 100000
"""

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """What a router does with a vLLM engine's events: a SUB socket on the topic, an
    index of cached hashes (a count per hash: one per cached block), and, on a gap in
    the sequence numbers, a replay from the ROUTER socket of everything missed."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str, topic: bytes) -> None:
        self.ctx, self.endpoint, self.replay_endpoint, self.topic = ctx, endpoint, replay, topic
        self.index: Counter[bytes] = Counter()
        self.last = -1
        self.replays = 0
        self.skips = 0
        self.clears = 0
        self.sub: zmq.Socket | None = None
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def disconnect(self) -> None:
        assert self.sub is not None
        self.sub.close(linger=0)
        self.sub = None

    def apply(self, seq: int, payload: bytes, skip: bool = False) -> None:
        """Apply batch ``seq``: the next one, or with ``skip`` (a replay's first batch)
        any later one: a restarted publisher numbers on past every number it may have
        used before, so the numbers in between never existed."""
        assert seq == self.last + 1 or (skip and seq > self.last), (seq, self.last)
        if seq != self.last + 1:
            self.skips += 1
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if isinstance(e, VllmStored):
                assert e.medium == "GPU" and e.block_size in (4, 8)
                self.index.update(e.block_hashes)
            elif isinstance(e, VllmRemoved):
                for h in e.block_hashes:
                    self.index[h] -= 1
                    assert self.index[h] >= 0
                    if not self.index[h]:
                        del self.index[h]
            else:
                assert isinstance(e, VllmCleared)
                self.clears += 1
                self.index.clear()
        self.last = seq

    def replay(self, start: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            first = True
            for _ in range(1_000_000):
                assert dealer.poll(10_000), "no replay answer"
                _, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    break
                if seq > self.last:
                    self.apply(seq, payload, skip=first)
                first = False
        finally:
            dealer.close(linger=0)
        self.replays += 1

    def drain(self, quiet_ms: int = 500) -> None:
        """Apply what has arrived, until nothing more arrives for ``quiet_ms``."""
        assert self.sub is not None
        while self.sub.poll(quiet_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last:  # else a batch a replay delivered already
                self.apply(seq, payload)

    def pump(self, until: Counter[bytes], timeout: float = 20.0, past: int = -1) -> None:
        """Receive (and replay on a gap) until the index equals ``until`` (and a batch
        numbered above ``past`` was applied)."""
        assert self.sub is not None
        deadline = time.monotonic() + timeout
        while self.index != until or self.last <= past:
            left = deadline - time.monotonic()
            assert left > 0, (
                f"index differs: {len(self.index)} hashes against the pool's {len(until)} (last {self.last}, replays {self.replays}, skips {self.skips})"
            )
            if not self.sub.poll(int(min(left, 1.0) * 1000)):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last:
                continue
            if seq > self.last + 1:
                self.replay(self.last + 1)
                if seq <= self.last:
                    continue
            self.apply(seq, payload)


def _pool_map(server: InProcessServer, pool: str) -> Counter[bytes]:
    """The pool's prefix-cache map as raw hash -> cached blocks under it (every group)."""

    def read() -> Counter[bytes]:
        engine = server.running.servicer.registry.pools[pool].engine  # type: ignore[union-attr]
        out: Counter[bytes] = Counter()
        for key, ids in engine.block_pool.cached_block_hash_to_block.items():
            out[key[:-4]] += len(ids)  # the key is hash ‖ 4-byte group id
        return out

    return server.call(read)  # type: ignore[no-any-return]


@pytest.fixture
def events_server() -> Iterator[InProcessServer]:
    srv = InProcessServer(CONFIG).start()
    yield srv
    srv.stop()


def test_subscriber_index_equals_the_pool_after_every_step(events_server: InProcessServer) -> None:
    """Three workers with shared prefixes allocate and free in a small hybrid pool
    (evictions all the time); after each step a subscriber's index, built from vLLM's
    decoded KVEventBatch messages, equals the pool's hash map. It drops its connection
    twice for several steps, then reconnects: the first message after a gap makes it
    replay the missed batches from the ROUTER socket, and its index is equal again.
    Meanwhile a subscriber with a high-water mark of 1 that never reads is connected
    the whole time: every step still completes and the publisher keeps sending."""
    server = events_server
    publisher = server.running.publishers.publishers["hy"]  # type: ignore[union-attr]
    ctx = zmq.Context.instance()
    sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint, b"kv@hy")
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(publisher.endpoint)
    time.sleep(0.3)  # PUB/SUB: subscriptions reach the publisher asynchronously
    rnd = random.Random(11)
    prefixes = [[rnd.randrange(100) for _ in range(n)] for n in (12, 24, 40)]
    try:
        _drive(server, sub, rnd, prefixes)
    finally:
        stalled.close(linger=0)
        if sub.sub is not None:
            sub.disconnect()
    assert sub.replays == 2
    assert len(sub.index) > 0


def _drive(server: InProcessServer, sub: Subscriber, rnd: random.Random, prefixes: list[list[int]]) -> None:
    with KVCoordClient(server.address, timeout=10) as client:
        cfg = client.get_pool("hy").pool.config
        workers = [PoolWorker(client, "hy", cfg, random.Random(i)) for i in range(3)]
        offline = set(range(20, 26)) | set(range(50, 53))
        for step in range(90):
            w = workers[step % 3]
            w.step(rnd.choice(prefixes) + [rnd.randrange(100) for _ in range(rnd.randint(1, 30))], None)
            if step in offline:
                if sub.sub is not None:
                    sub.disconnect()
                continue
            if sub.sub is None:
                sub.connect()
                time.sleep(0.3)
                # the next message shows the gap: one more step, then catch up
                w.step([rnd.randrange(100) for _ in range(9)], None)
            sub.pump(_pool_map(server, "hy"))


def _recovered_map(server: DurableServer, copy: Path, config: str) -> Counter[bytes]:
    """The pool's hash map as a server recovering the killed server's data directory
    has it (on a copy: what the restarted server starts from)."""
    shutil.copytree(server.data_dir, copy)
    recovered = InProcessServer(config.split("[[kv_events]]")[0], data_dir=str(copy)).start()
    try:
        return _pool_map(recovered, "hy")
    finally:
        recovered.stop()


def test_a_subscriber_follows_the_pool_across_server_restarts(tmp_path: Path) -> None:
    """A journaled server process publishing on fixed ports is killed (SIGKILL) right
    after a burst of steps, three times, and restarted, while a subscriber stays
    connected (ZMQ reconnects it). After each restart its index (vLLM's decoded
    batches, a count per cached block) equals the recovered pool's hash map, including
    the events the killed server committed but had not sent: the restarted publisher
    numbers its batches on past every number used before (the subscriber sees a gap
    and replays; no number it holds is reused for other events), and its first batch
    clears the index and sends the events the pool keeps (here its whole history: the
    pool is large enough for its event buffer to keep it)."""
    pub, replay = free_port(), free_port()
    toml = (
        CONFIG.replace("num_blocks = 48", "num_blocks = 400")
        .replace('\nendpoint = "tcp://127.0.0.1:*"', f'\nendpoint = "tcp://*:{pub}"')
        .replace('replay_endpoint = "tcp://127.0.0.1:*"', f'replay_endpoint = "tcp://127.0.0.1:{replay}"')
    )
    assert f"*:{pub}" in toml and f":{replay}" in toml
    server = DurableServer(tmp_path, toml)
    server.start()
    sub = Subscriber(zmq.Context.instance(), f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", b"kv@hy")
    time.sleep(0.3)
    rnd = random.Random(5)
    prefixes = [[rnd.randrange(100) for _ in range(n)] for n in (12, 24, 40)]
    try:
        for restart in range(3):
            with KVCoordClient(server.address, timeout=10) as client:
                cfg = client.get_pool("hy").pool.config
                workers = [PoolWorker(client, "hy", cfg, random.Random(10 * restart + i)) for i in range(3)]
                for step in range(25):
                    workers[step % 3].step(
                        rnd.choice(prefixes) + [rnd.randrange(100) for _ in range(rnd.randint(1, 30))], None
                    )
            server.kill()
            expected = _recovered_map(server, tmp_path / f"copy-{restart}", toml)
            sub.drain()  # what the killed server sent
            last_before = sub.last
            server.start()
            sub.pump(expected, past=last_before)  # the restarted publisher's first batch
            assert sub.skips == restart + 1  # the restart was a gap, filled by a replay
            assert sub.clears == restart + 1  # and the replay began with the clear
    finally:
        sub.disconnect()
        server.stop()


def test_payload_decodes_with_vllms_classes() -> None:
    """Each event kind (bytes and integer hashes, a parent or none, LoRA) decodes into
    vLLM's own classes with every field in place."""
    stored = BlockStored((b"\x01" * 32, b"\x02" * 32), None, (1, 2, 3, 4, 5, 6, 7, 8), 4, 3, "ad")
    child = BlockStored((b"\x03" * 32,), b"\x02" * 32, (9, 10, 11, 12), 4, None, None)
    removed = BlockRemoved((b"\x01" * 32,))
    batch = DECODER.decode(encode_batch(12.5, [stored, child, removed], 0))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    a, b, c = batch.events
    assert a == VllmStored(
        block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        block_size=4, lora_id=3, medium="GPU", lora_name="ad",
    )  # fmt: skip
    assert b.parent_block_hash == b"\x02" * 32 and b.lora_id is None and b.lora_name is None
    assert c == VllmRemoved(block_hashes=[b"\x01" * 32], medium="GPU")
    as_ints = DECODER.decode(encode_batch(1.0, [child], 2, int_hashes=True))
    assert as_ints.data_parallel_rank == 2
    assert as_ints.events[0].block_hashes == [hash_to_int64(b"\x03" * 32)]
    assert as_ints.events[0].parent_block_hash == hash_to_int64(b"\x02" * 32)


def test_a_pool_created_again_is_announced_as_cleared(events_server: InProcessServer) -> None:
    """Deleting the pool and creating it again publishes AllBlocksCleared: the
    subscriber's index empties, and then follows the new pool's events."""
    server = events_server
    publisher = server.running.publishers.publishers["hy"]  # type: ignore[union-attr]
    sub = Subscriber(zmq.Context.instance(), publisher.endpoint, publisher.replay_endpoint, b"kv@hy")
    time.sleep(0.3)
    try:
        with KVCoordClient(server.address, timeout=10) as client:
            cfg = client.get_pool("hy").pool.config
            PoolWorker(client, "hy", cfg, random.Random(1)).step(list(range(30)), None)
            sub.pump(_pool_map(server, "hy"))
            assert sub.index
            client.delete_pool("hy")
            client.create_pool("hy", cfg)
            PoolWorker(client, "hy", cfg, random.Random(2)).step(list(range(50, 70)), None)
            expected = _pool_map(server, "hy")
            sub.pump(expected)
            assert sub.index == expected and b"" not in sub.index
    finally:
        sub.disconnect()
