"""A pool's KV events on ZMQ in vLLM's own wire format, decoded with vLLM's own
classes: a subscriber's index equals the pool's prefix-cache map after every step,
also after it drops its connection and replays what it missed; a subscriber that reads
nothing never holds up the pool.

Runs in both vLLM venvs: under vLLM 0.16.0 the pool follows the vllm-0.16 profile
(0.16's array-encoded events), under 0.33.0 the vllm-0.33 profile (0.33's map-encoded
events with their group, spec and extra-key fields, and 0.33's replay framing), each
decoded by that release's own classes. A 0.33 subscriber's index is keyed by (group,
hash), as 0.33's group_idx allows, and is compared with the pool's map per group.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from durable_server import DurableServer, free_port
from harness import V033
from kvcoord.client import KVCoordClient
from kvcoord.client.hashing import block_hasher, none_hash
from kvcoord.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, hash_to_int64
from kvcoord.engine.profiles import VLLM_016, VLLM_033
from kvcoord.service.kv_publisher import encode_batch
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import PoolWorker
from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
from vllm.distributed.kv_events import BlockStored as VllmStored
from vllm.distributed.kv_events import KVEventBatch

#: the profile of the installed vLLM: the format its decoder classes read
PROFILE = VLLM_033 if V033 else VLLM_016

CONFIG = f"""
[[pools]]
name = "hy"
profile = "{PROFILE}"
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
int_hashes = false  # (the subscriber's index is compared with the pool's hashes)
"""

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)

#: a subscriber's index key: 0.33's events name the group, 0.16's do not
Key = tuple[int, bytes] | bytes


class Worker(PoolWorker):
    """:class:`PoolWorker` of either profile: it attaches with the pool's profile and
    hashes as that profile's workers do (0.33: tagged extra keys, the LoRA path)."""

    def __init__(self, client: KVCoordClient, pool: str, cfg: pb.PoolConfig, rnd: random.Random) -> None:
        self.client, self.pool, self.cfg, self.rnd = client, pool, cfg, rnd
        r = client.attach(pool, cfg.hash_algo, cfg.hash_block_size, cfg.hash_seed, profile=cfg.profile)
        self.sid, self.fence = r.session_id, r.fence
        self.live: list[str] = []
        self.n = 0

    def hashes(self, tokens: list[int], lora: str | None = None) -> list[bytes]:
        profile = self.cfg.profile or VLLM_016
        none = none_hash(self.cfg.hash_algo, self.cfg.hash_seed, profile=profile)
        path = {"lora_path": f"loras/{lora}"} if lora and profile == VLLM_033 else {}
        hasher = block_hasher(
            profile, self.cfg.hash_algo, self.cfg.hash_block_size, none, lora_name=lora, **path
        )
        return hasher.extend(tokens)


class Subscriber:
    """What a router does with a vLLM engine's events: a SUB socket on the topic, an
    index of cached hashes (a count per hash: one per cached block), and, on a gap in
    the sequence numbers, a replay from the ROUTER socket of everything missed."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str, topic: bytes) -> None:
        self.ctx, self.endpoint, self.replay_endpoint, self.topic = ctx, endpoint, replay, topic
        self.index: Counter[Key] = Counter()
        self.last = -1
        self.replays = 0
        self.skips = 0
        self.clears = 0
        #: blocks stored with a LoRA's extra keys (0.33)
        self.lora_blocks = 0
        self.sub: zmq.Socket | None = None
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def subscribed(self) -> None:
        """Wait until the publisher answers this first subscription (an empty batch under
        the next number, 0 on a fresh pool: nothing was missed) and apply it. A batch
        published before the subscription reached the publisher never reaches this
        subscriber: a fixed 0.3 s was the wait, which a loaded machine can outlast
        (then the first batch read is not number 0). The bound is on a hang only."""
        assert self.sub is not None
        assert self.sub.poll(120_000), "the subscription was never answered"
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic
        self.apply(int.from_bytes(seq_bytes, "big"), payload)

    def disconnect(self) -> None:
        assert self.sub is not None
        self.sub.close(linger=0)
        self.sub = None

    def apply(self, seq: int, payload: bytes, skip: bool = False) -> None:
        """Apply batch ``seq``: the next one, or with ``skip`` (a replay's batches, and
        the live batch that showed the gap) any later one: a restarted publisher
        numbers on past every number it may have used before, so the numbers in
        between never existed, and the empty batch answering a subscription is not
        kept for replay (its number is skipped there)."""
        assert seq == self.last + 1 or (skip and seq > self.last), (seq, self.last)
        if seq != self.last + 1:
            self.skips += 1
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if isinstance(e, VllmStored):
                assert e.medium == "GPU" and e.block_size in (4, 8)
                if V033:
                    assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (
                        ("full_attention", None) if e.group_idx == 0 else ("sliding_window", 16)
                    ), e
                    # one entry per hashed block (vLLM skips the blocks sparse retention
                    # leaves unhashed), with the request's LoRA name when it has one
                    assert len(e.extra_keys or ()) == len(e.block_hashes), e
                    assert all(k in (None, ("ad",)) for k in e.extra_keys or ()), e
                    self.lora_blocks += sum(k == ("ad",) for k in e.extra_keys or ())
                    self.index.update((e.group_idx, h) for h in e.block_hashes)
                else:
                    self.index.update(e.block_hashes)
            elif isinstance(e, VllmRemoved):
                for h in e.block_hashes:
                    key: Key = (e.group_idx, h) if V033 else h
                    self.index[key] -= 1
                    assert self.index[key] >= 0
                    if not self.index[key]:
                        del self.index[key]
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
            for _ in range(1_000_000):
                assert dealer.poll(10_000), "no replay answer"
                if V033:  # 0.33 frames a replayed batch as the PUB socket does, topic first
                    _, topic, seq_bytes, payload = dealer.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big", signed=True)
                    assert topic == (b"" if seq == -1 else self.topic)
                else:
                    _, seq_bytes, payload = dealer.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    break
                if seq > self.last:
                    self.apply(seq, payload, skip=True)
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

    def pump(self, until: Counter[Key], timeout: float = 20.0, past: int = -1) -> None:
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
            gap = seq > self.last + 1
            if gap:
                self.replay(self.last + 1)
                if seq <= self.last:
                    continue
            self.apply(seq, payload, skip=gap)


def _pool_map(server: InProcessServer, pool: str) -> Counter[Key]:
    """The pool's prefix-cache map as raw hash (under 0.33: (group, hash)) -> cached
    blocks under it (every group)."""

    def read() -> Counter[Key]:
        engine = server.running.servicer.registry.pools[pool].engine  # type: ignore[union-attr]
        out: Counter[Key] = Counter()
        for key, ids in engine.block_pool.cached_block_hash_to_block.items():
            # the key is hash ‖ 4-byte group id
            out[(int.from_bytes(key[-4:], "big"), key[:-4]) if V033 else key[:-4]] += len(ids)
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
    sub.subscribed()  # (before the stalled one's: its answer takes the next number)
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
    assert sub.lora_blocks > 0 or not V033


def _drive(server: InProcessServer, sub: Subscriber, rnd: random.Random, prefixes: list[list[int]]) -> None:
    with KVCoordClient(server.address, timeout=10) as client:
        cfg = client.get_pool("hy").pool.config
        workers = [Worker(client, "hy", cfg, random.Random(i)) for i in range(3)]
        offline = set(range(20, 26)) | set(range(50, 53))
        for step in range(90):
            w = workers[step % 3]
            # under 0.33 every fifth request has a LoRA: its blocks' events carry extra keys
            lora = "ad" if V033 and step % 5 == 4 else None
            w.step(rnd.choice(prefixes) + [rnd.randrange(100) for _ in range(rnd.randint(1, 30))], lora)
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


def _recovered_map(server: DurableServer, copy: Path, config: str) -> Counter[Key]:
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
    sub.subscribed()
    rnd = random.Random(5)
    prefixes = [[rnd.randrange(100) for _ in range(n)] for n in (12, 24, 40)]
    try:
        for restart in range(3):
            with KVCoordClient(server.address, timeout=10) as client:
                cfg = client.get_pool("hy").pool.config
                workers = [Worker(client, "hy", cfg, random.Random(10 * restart + i)) for i in range(3)]
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


@pytest.mark.skipif(V033, reason="vLLM 0.16.0's encoding (vllm-0.16 pools); 0.33's is tested below")
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


@pytest.mark.skipif(not V033, reason="vLLM 0.33.0's encoding (vllm-0.33 pools)")
@pytest.mark.parametrize("int_hashes", [False, True])
def test_033_payload_is_the_bytes_vllm_033_encodes(int_hashes: bool) -> None:
    """A vllm-0.33 pool's batch is byte for byte what vLLM 0.33.0's publisher encodes
    for the same events (its own classes through its own msgspec encoder): every
    optional field set or not (extra keys with LoRA names, salts and multimodal
    pairs, group, spec kind, sliding window, look-ahead tokens), parents or none,
    integer hashes or bytes; and it decodes back into those events."""
    h = [bytes([i]) * 32 for i in range(1, 6)]

    def ext(x: bytes) -> bytes | int:  # vLLM's maybe_convert_block_hash
        return int.from_bytes(x, "big") & ((1 << 64) - 1) if int_hashes else x

    ours = [
        BlockStored((h[0], h[1]), None, tuple(range(8)), 4, 3, "ad", extra_keys=(("ad", "salt"), ("ad",)),
                    group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockStored((h[2],), h[1], (8, 9, 10, 11), 4, None, None, extra_keys=(None,), group_idx=1,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=16,
                    lookahead_token_ids=((12,),)),
        BlockStored((), h[2], (12, 13, 14, 15, 16, 17, 18, 19), 8, None, None,
                    extra_keys=((("img", 3),), None), group_idx=1, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=16),
        BlockStored((h[3],), None, (1, 2, 3, 4), 4, None, None),
        BlockRemoved((h[0],), group_idx=0),
        BlockRemoved((h[4],)),
        AllBlocksCleared(),
    ]  # fmt: skip
    theirs = [
        VllmStored(block_hashes=[ext(h[0]), ext(h[1])], parent_block_hash=None, token_ids=list(range(8)),
                   block_size=4, lora_id=3, medium="GPU", lora_name="ad", extra_keys=[("ad", "salt"), ("ad",)],
                   group_idx=0, kv_cache_spec_kind="full_attention"),
        VllmStored(block_hashes=[ext(h[2])], parent_block_hash=ext(h[1]), token_ids=[8, 9, 10, 11],
                   block_size=4, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=1,
                   kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=16,
                   lookahead_token_ids=[[12]]),
        VllmStored(block_hashes=[], parent_block_hash=ext(h[2]), token_ids=list(range(12, 20)), block_size=8,
                   lora_id=None, medium="GPU", lora_name=None, extra_keys=[(("img", 3),), None], group_idx=1,
                   kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=16),
        VllmStored(block_hashes=[ext(h[3])], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
                   lora_id=None, medium="GPU", lora_name=None),
        VllmRemoved(block_hashes=[ext(h[0])], medium="GPU", group_idx=0),
        VllmRemoved(block_hashes=[ext(h[4])], medium="GPU"),
        VllmCleared(),
    ]  # fmt: skip
    payload = encode_batch(12.5, ours, 1, int_hashes, VLLM_033)
    # what vLLM 0.33's ZmqEventPublisher sends: its encoder over the scheduler's batch
    # (the publisher sets the rank)
    assert payload == msgspec.msgpack.Encoder().encode(
        KVEventBatch(ts=12.5, events=theirs, data_parallel_rank=1)
    )
    batch = DECODER.decode(payload)
    assert (batch.ts, batch.data_parallel_rank) == (12.5, 1)
    # field by field (JSON: msgspec decodes the tuples inside extra keys as lists)
    assert [msgspec.json.encode(e) for e in batch.events] == [msgspec.json.encode(e) for e in theirs]
    assert [type(e) for e in batch.events] == [type(e) for e in theirs]


@pytest.mark.skipif(not V033, reason="vLLM 0.33.0's extra keys (vllm-0.33 pools)")
@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("kind", ["embeds", "mm"])
def test_033_extra_keys_of_embeds_and_multimodal_requests_are_vllm_033s(
    kind: str, lookahead: int, server: InProcessServer
) -> None:
    """A request given as prompt embeddings, and one with two multimodal items (one
    starting inside a block, one spanning four): vLLM 0.33.0's own KVCacheManager
    publishes each cached block's prompt-embeds digest or (identifier, offset) pairs
    (negative offsets for an item begun in an earlier block; with look-ahead hashes the
    span reaches the next token) in BlockStored.extra_keys. kvcoord's client registers
    the request's sources (extract_key_sources_033 of the same vLLM request), the pool
    publishes the events over the wire, and their batch is byte for byte what vLLM
    0.33.0's encoder makes of vLLM's events. (Before, the plug-in refused both requests,
    and a pool published only LoRA names and salts.)"""
    import torch
    from kvcoord.client.vllm033 import extra_key_sources_033
    from kvcoord.wire import events_from_pb, write_extra_key_sources
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1 import kv_cache_interface as k
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    block, n = 4, 22
    init_none_hash(sha256_cbor)
    spec = k.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16)
    kv = k.KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[k.KVCacheGroupSpec(["l0"], spec)],
        hash_block_size=block,
    )
    theirs_manager = KVCacheManager(
        kv, max_model_len=256, scheduler_block_size=block, hash_block_size=block, enable_caching=True,
        num_hash_lookahead_tokens=lookahead, enable_kv_cache_events=True,
    )  # fmt: skip
    hasher = get_request_block_hasher(block, sha256_cbor, lookahead)
    if kind == "embeds":
        embeds = torch.randn(n, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
        request = Request(
            "r", None, SamplingParams(max_tokens=4), None, prompt_embeds=embeds, block_hasher=hasher
        )
    else:
        features = [
            MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset=off, length=length))
            for ident, off, length in (("img-a", 2, 5), ("img-b", 9, 8))
        ]
        request = Request("r", list(range(100, 100 + n)), SamplingParams(max_tokens=4), None,
                          mm_features=features, block_hasher=hasher)  # fmt: skip
    assert theirs_manager.allocate_slots(request, n) is not None
    theirs = theirs_manager.take_events()
    assert theirs and all(e.extra_keys for e in theirs), theirs

    cfg = pb.PoolConfig(
        num_blocks=32, hash_block_size=block, enable_caching=True, enable_kv_cache_events=True,
        max_model_len=256, hash_algo="sha256_cbor", hash_seed="0", profile=VLLM_033,
        num_hash_lookahead_tokens=lookahead, scheduler_block_size=block,
    )  # fmt: skip
    cfg.groups.add().full.CopyFrom(
        pb.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype="float16")
    )
    pool = f"xk-{kind}-{lookahead}"
    with KVCoordClient(server.address) as c:
        c.create_pool(pool, cfg)
        a = c.attach(pool, "sha256_cbor", block, "0", profile=VLLM_033, num_hash_lookahead_tokens=lookahead)
        sync = pb.RequestSync(
            request_id="r", new_request=True, append_token_ids=request.all_token_ids,
            append_block_hashes=[bytes(h) for h in request.block_hashes],
        )  # fmt: skip
        sources = extra_key_sources_033(request, block, lookahead)
        assert sources is not None
        write_extra_key_sources(sources, sync)
        op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=n))
        r = c.step(pool, [op], a.session_id, fence=a.fence, include_state=True)
        assert not r.results[0].allocate.refused
        ours = events_from_pb(r.events)
        c.delete_pool(pool)
    assert msgspec.msgpack.Encoder().encode(KVEventBatch(ts=3.0, events=theirs, data_parallel_rank=0)) == (
        # (vLLM's hashes are integers unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        encode_batch(3.0, ours, 0, isinstance(theirs[0].block_hashes[0], int), VLLM_033)
    )


def test_a_pool_created_again_is_announced_as_cleared(events_server: InProcessServer) -> None:
    """Deleting the pool and creating it again publishes AllBlocksCleared: the
    subscriber's index empties, and then follows the new pool's events."""
    server = events_server
    publisher = server.running.publishers.publishers["hy"]  # type: ignore[union-attr]
    sub = Subscriber(zmq.Context.instance(), publisher.endpoint, publisher.replay_endpoint, b"kv@hy")
    sub.subscribed()
    try:
        with KVCoordClient(server.address, timeout=10) as client:
            cfg = client.get_pool("hy").pool.config
            Worker(client, "hy", cfg, random.Random(1)).step(list(range(30)), None)
            sub.pump(_pool_map(server, "hy"))
            assert sub.index
            client.delete_pool("hy")
            client.create_pool("hy", cfg)
            Worker(client, "hy", cfg, random.Random(2)).step(list(range(50, 70)), None)
            expected = _pool_map(server, "hy")
            sub.pump(expected)
            assert sub.index == expected and b"" not in sub.index
    finally:
        sub.disconnect()


@pytest.mark.skipif(not V033, reason="vLLM 0.33.0's kv_cache_report_mode (vllm-0.33 pools)")
@pytest.mark.parametrize("via", ["lookup", "atomic"])
@pytest.mark.parametrize("layout", ["full", "full+swa"])
def test_033_full_report_mode_re_announces_hits_as_vllm_033(
    layout: str, via: str, server: InProcessServer
) -> None:
    """A request with ``kv_cache_report_mode="full"`` (sampling_params.extra_args) whose
    prefix is cached: vLLM 0.33.0's own KVCacheManager re-emits a BlockStored per group
    for the hit's blocks in get_computed_blocks (from block 0, no parent, the sliding
    window's null positions listed too), then the allocation's own stores. kvcoord's
    pool, told the mode at registration (RequestSync.kv_cache_report_full), publishes
    the same batch byte for byte, through a LookupOp then an allocation of its hit, or
    an atomic lookup-and-allocate. (Before, the 0.33 plug-in refused the request, and
    a pool published only the allocation's stores.)"""
    import torch
    from kvcoord.wire import events_from_pb
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1 import kv_cache_interface as k
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    block, window, n = 4, 6, 26
    init_none_hash(sha256_cbor)
    specs = [k.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16)]
    if layout == "full+swa":
        specs.append(k.SlidingWindowSpec(
            block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=window
        ))  # fmt: skip
    kv = k.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[k.KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
        hash_block_size=block,
    )
    vllm_manager = KVCacheManager(
        kv, max_model_len=256, scheduler_block_size=block, hash_block_size=block, enable_caching=True,
        enable_kv_cache_events=True,
    )  # fmt: skip
    hasher = get_request_block_hasher(block, sha256_cbor)
    first = Request("a", list(range(100, 100 + n)), SamplingParams(max_tokens=4), None, block_hasher=hasher)
    params = SamplingParams(max_tokens=4, extra_args={"kv_cache_report_mode": "full"})
    tokens = [*range(100, 100 + 18), *range(500, 500 + 7)]
    second = Request("b", tokens, params, None, block_hasher=hasher)
    assert second.kv_cache_report_mode == "full"
    assert vllm_manager.allocate_slots(first, n) is not None
    vllm_manager.free(first)
    vllm_manager.take_events()
    hit_blocks, hit_tokens, _ = vllm_manager.get_computed_blocks(second)
    assert hit_tokens == 16
    # (the sliding window's hit starts with null blocks: re-announced with the rest)
    assert layout == "full" or hit_blocks.blocks[1][0].is_null
    new = vllm_manager.allocate_slots(second, len(tokens) - hit_tokens, hit_tokens, hit_blocks)
    assert new is not None
    theirs = vllm_manager.take_events()
    re_announced = [e for e in theirs if e.parent_block_hash is None and len(e.block_hashes) == 4]
    assert len(re_announced) == len(specs), theirs

    cfg = pb.PoolConfig(
        num_blocks=64, hash_block_size=block, enable_caching=True, enable_kv_cache_events=True,
        max_model_len=256, hash_algo="sha256_cbor", hash_seed="0", profile=VLLM_033, scheduler_block_size=block,
    )  # fmt: skip
    cfg.groups.add().full.CopyFrom(
        pb.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype="float16")
    )
    if layout == "full+swa":
        cfg.groups.add().sliding_window.CopyFrom(pb.SlidingWindowSpec(
            block_size=block, sliding_window=window, num_kv_heads=1, head_size=8, dtype="float16"
        ))  # fmt: skip
    if kv.prefix_cache_retention_interval is None:  # (vLLM keeps every sliding-window hash)
        cfg.prefix_cache_retention_interval = -1
    pool = f"report-{layout.replace('+', '-')}-{via}"

    def sync_of(request: Any) -> pb.RequestSync:
        return pb.RequestSync(
            request_id=request.request_id, new_request=True, append_token_ids=request.all_token_ids,
            append_block_hashes=[bytes(h) for h in request.block_hashes],
        )  # fmt: skip

    with KVCoordClient(server.address) as c:
        c.create_pool(pool, cfg)
        a = c.attach(pool, "sha256_cbor", block, "0", profile=VLLM_033)
        r = c.step(pool, [
            pb.Operation(allocate=pb.AllocateOp(request=sync_of(first), num_new_tokens=n)),
            pb.Operation(free=pb.FreeOp(request_id="a")),
        ], a.session_id, fence=a.fence, include_state=True)  # fmt: skip
        assert not r.results[0].allocate.refused and r.events  # (the first request's stores)
        sync = sync_of(second)
        sync.kv_cache_report_full = True
        if via == "lookup":
            lookup = pb.Operation(lookup=pb.LookupOp(request=sync))
            r = c.step(pool, [lookup], a.session_id, fence=a.fence, include_state=True)
            hit = r.results[0].lookup.hit
            assert hit.num_tokens == hit_tokens
            events = events_from_pb(r.events)
            alloc = pb.AllocateOp(
                request=pb.RequestSync(request_id="b", base_num_tokens=len(tokens), base_num_hashes=len(tokens) // block),
                num_new_tokens=len(tokens) - hit_tokens, num_new_computed_tokens=hit_tokens, new_computed_blocks=hit,
            )  # fmt: skip
        else:
            events = []
            alloc = pb.AllocateOp(request=sync, num_new_tokens=len(tokens), lookup=True)
        r = c.step(pool, [pb.Operation(allocate=alloc)], a.session_id, fence=a.fence, include_state=True)
        assert r.results[0].status_code == 0 and not r.results[0].allocate.refused, r.results[0]
        events += events_from_pb(r.events)
        c.delete_pool(pool)
    assert msgspec.msgpack.Encoder().encode(KVEventBatch(ts=3.0, events=theirs, data_parallel_rank=0)) == (
        encode_batch(3.0, events, 0, isinstance(theirs[0].block_hashes[0], int), VLLM_033)
    )
