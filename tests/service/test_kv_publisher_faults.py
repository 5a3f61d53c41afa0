"""A ``[[kv_events]]`` publisher over real ZMQ sockets when things go wrong: a
subscriber away for longer than the replay buffer keeps (or across a restart), a batch that cannot be sent
(a full disk under the batch-number reservation), a publisher thread that stopped, and
replay requests whose answers are never read.

The subscriber is docs/routing.md's: it counts blocks per hash, replays from its last
number plus one on a gap, and applies every batch numbered above its last."""

from __future__ import annotations

import errno
import random
import resource
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.engine import BlockStored  # noqa: E402
from kvcoord.service import kv_publisher  # noqa: E402
from kvcoord.service.kv_publisher import KVEventPublisher, KVEventsDecl  # noqa: E402
from kvcoord.service.testing import InProcessServer  # noqa: E402
from support import PoolWorker, scrape_metrics  # noqa: E402

POOL = """
[[pools]]
name = "p"
num_blocks = 24
hash_block_size = 4
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true
max_model_len = 256

[[pools.groups]]
type = "full"
block_size = 4

[[kv_events]]
pool = "p"
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"
topic = "kv"
int_hashes = false
"""
GAPS = ("kvcoord_event_gaps_total", (("pool", "p"), ("stream", "zmq")))


class Endpoints(NamedTuple):
    """A publisher's PUB and replay addresses (a :class:`Subscriber`'s, when the
    publisher runs in another process)."""

    endpoint: str
    replay_endpoint: str


class Subscriber:
    """docs/routing.md's subscriber (0.16 payloads): a count of cached blocks per hash.
    tests/service/test_kv_publisher_hwm.py and tests/cluster/test_kv_events_moved.py
    subclass it."""

    def __init__(self, publisher: KVEventPublisher | Endpoints) -> None:
        self.ctx = zmq.Context.instance()
        self.publisher = publisher
        self.index: Counter[bytes] = Counter()
        self.last = -1
        self.batches: list[list[Any]] = []
        self.sub: Any = None

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(self.publisher.endpoint)
        time.sleep(0.3)  # (the subscription reaches the publisher)

    def close(self) -> None:
        self.sub.close(linger=0)

    def apply(self, payload: bytes) -> None:
        _ts, events, _rank = msgspec.msgpack.decode(payload)
        self.batches.append(events)
        for e in events:
            if e[0] == "BlockStored":
                self.index.update(e[1])
            elif e[0] == "BlockRemoved":
                for h in e[1]:
                    self.removed(h)
            else:
                self.index.clear()

    def removed(self, h: bytes) -> None:
        """A ``BlockRemoved`` of hash ``h``: one block of it less."""
        self.index[h] -= 1  # (docs/routing.md's dict raises KeyError instead)
        assert self.index[h] >= 0, "a removal of a block this subscriber was never sent"
        if not self.index[h]:
            del self.index[h]

    def replay(self, start: int) -> Iterator[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.publisher.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            for _ in range(10_000):
                assert dealer.poll(10_000), "no replay answer"
                _, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return
                yield int.from_bytes(seq, "big"), payload
        finally:
            dealer.close(linger=0)

    def drain(self, quiet_ms: int = 700) -> None:
        """docs/routing.md's loop, until the stream is quiet for ``quiet_ms``."""
        for _ in range(10_000):
            if not self.sub.poll(quiet_ms):
                return
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last + 1:
                for s, p in list(self.replay(self.last + 1)):
                    if s > self.last:
                        self.apply(p)
                        self.last = s
            if seq > self.last:
                self.apply(payload)
                self.last = seq


def _cached(server: InProcessServer) -> Counter[bytes]:
    """The pool's map: cached blocks per hash."""

    def read() -> Counter[bytes]:
        engine = server.running.servicer.registry.pools["p"].engine  # type: ignore[union-attr]
        out: Counter[bytes] = Counter()
        for key, ids in engine.block_pool.cached_block_hash_to_block.items():
            out[key[:-4]] += len(ids)  # (the key's last 4 bytes: its group)
        return out

    return server.call(read)  # type: ignore[no-any-return]


def _prompt(rnd: random.Random) -> list[int]:
    return [rnd.randrange(1000) for _ in range(20)]


def test_a_subscriber_away_longer_than_the_replay_buffer_gets_the_pools_blocks() -> None:
    """Away for 30 Steps with buffer_steps = 5, every block it knew evicted meanwhile:
    its replay cannot be answered whole, so it is answered with one batch, a clear and
    every block the stream leaves stored. Its index is the pool's map afterwards (it
    held 35 hashes the pool no longer caches when the replay answered with the kept
    batches alone, which remove blocks it never saw stored)."""
    srv = InProcessServer(POOL.replace('topic = "kv"', 'topic = "kv"\nbuffer_steps = 5')).start()
    sub = None
    try:
        publisher = srv.running.publishers.publishers["p"]  # type: ignore[union-attr]
        sub = Subscriber(publisher)
        sub.connect()
        rnd = random.Random(1)
        with KVCoordClient(srv.address, timeout=10) as client:
            worker = PoolWorker(client, "p", client.get_pool("p").pool.config, rnd)
            for _ in range(3):
                worker.step(_prompt(rnd), None)
            sub.drain()
            assert sub.index == _cached(srv) and sub.index
            sub.close()
            for _ in range(30):
                worker.step(_prompt(rnd), None)
            time.sleep(0.5)
            sub.connect()
            sub.drain()
        assert sub.index == _cached(srv)
        assert any(b and b[0] == ["AllBlocksCleared"] for b in sub.batches)
    finally:
        if sub is not None:
            sub.close()
        srv.stop()


class PresenceSubscriber(Subscriber):
    """docs/routing.md's loop, its index whether each hash is cached (no counts)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        super().__init__(publisher)
        self.present: set[bytes] = set()

    def apply(self, payload: bytes) -> None:
        _ts, events, _rank = msgspec.msgpack.decode(payload)
        self.batches.append(events)
        for e in events:
            if e[0] == "BlockStored":
                self.present.update(e[1])
            elif e[0] == "BlockRemoved":
                self.present.difference_update(e[1])
            else:
                self.present.clear()


@pytest.mark.parametrize("snapshot", [True, False])
def test_a_subscriber_away_across_a_restart_keeps_no_block_the_pool_evicted(
    tmp_path: Path, snapshot: bool
) -> None:
    """Away across a restart (a data directory), for longer than the replay buffer and
    the pool's event buffer keep: every block it knew is evicted meanwhile, and the
    restarted publisher's first batch cannot re-send those removals (dropped from the
    pool's event buffer). Its replay from a number of the
    old process is answered with the snapshot, as one the buffer dropped. It used to be
    answered with the new process's batches alone, and the subscriber kept hashes the
    pool no longer caches (15 of them here), silently. With a presence index."""
    config = (
        POOL.replace('topic = "kv"', 'topic = "kv"\nbuffer_steps = 5') + "\n[limits]\nevent_buffer = 40\n"
    )
    data = str(tmp_path / "data")
    rnd = random.Random(1)
    srv = InProcessServer(config, data_dir=data).start()
    try:
        sub = PresenceSubscriber(srv.running.publishers.publishers["p"])  # type: ignore[union-attr]
        sub.connect()
        with KVCoordClient(srv.address, timeout=10) as client:
            worker = PoolWorker(client, "p", client.get_pool("p").pool.config, rnd)
            for _ in range(3):
                worker.step(_prompt(rnd), None)
            sub.drain()
            assert sub.present == set(_cached(srv)) and sub.present
            known = set(sub.present)
            sub.close()
            for _ in range(30):  # every block it knew is evicted meanwhile
                worker.step(_prompt(rnd), None)
        time.sleep(0.5)
        assert not known & set(_cached(srv))
    finally:
        srv.stop(snapshot=snapshot)
    srv = InProcessServer(config, data_dir=data).start()
    try:
        sub.publisher = srv.running.publishers.publishers["p"]  # type: ignore[union-attr]
        time.sleep(0.5)
        sub.connect()
        sub.drain()
        phantoms = sub.present - set(_cached(srv))
        assert not phantoms, f"{len(phantoms)} hash(es) held that the pool no longer caches"
        assert any(b and b[0] == ["AllBlocksCleared"] for b in sub.batches[-2:])
    finally:
        sub.close()
        srv.stop()


@pytest.mark.parametrize("dropped", [True, False])
def test_a_first_look_after_a_restart_at_a_pool_whose_oldest_events_were_dropped_counts_a_gap(
    tmp_path: Path, dropped: bool
) -> None:
    """A restarted publisher's first batch is a clear and the events the pool kept.
    When the pool's event buffer dropped older ones, blocks they stored may still be
    cached and reach no subscriber: a gap, as a WatchEvents reader from 0 counts it.
    It was not counted in kvcoord_event_gaps_total{stream="zmq"} (its removals of
    blocks stored before the kept events were left out, silently). A pool whose whole
    history is kept counts none."""
    config = POOL + ("\n[limits]\nevent_buffer = 4\n" if dropped else "")
    data = str(tmp_path / "data")
    rnd = random.Random(5)
    srv = InProcessServer(config, data_dir=data).start()
    try:
        with KVCoordClient(srv.address, timeout=10) as client:
            worker = PoolWorker(client, "p", client.get_pool("p").pool.config, rnd)
            for _ in range(10):
                worker.step(_prompt(rnd), None)
        history = srv.call(lambda: srv.running.servicer.registry.pools["p"].events.oldest_sequence)  # type: ignore[union-attr]
        assert (history > 1) == dropped
    finally:
        srv.stop()
    srv = InProcessServer(config, data_dir=data).start()
    try:
        publisher = srv.running.publishers.publishers["p"]  # type: ignore[union-attr]
        for _ in range(200):  # (its first look at the pool: the clear and the kept events sent)
            if publisher.events_sent:
                break
            time.sleep(0.05)
        assert publisher.events_sent
        assert scrape_metrics(srv)[GAPS] == (1 if dropped else 0)
    finally:
        srv.stop()


def test_subscriptions_take_no_replay_slot() -> None:
    """Each subscription is answered with an empty batch under the next number, which
    is not kept for replay: subscribers coming and going push no batch out of the
    buffer (with buffer_steps = 5, ten of them used to push out every batch)."""
    srv = InProcessServer(POOL.replace('topic = "kv"', 'topic = "kv"\nbuffer_steps = 5')).start()
    try:
        publisher = srv.running.publishers.publishers["p"]  # type: ignore[union-attr]
        rnd = random.Random(2)
        with KVCoordClient(srv.address, timeout=10) as client:
            worker = PoolWorker(client, "p", client.get_pool("p").pool.config, rnd)
            worker.step(_prompt(rnd), None)
        time.sleep(0.3)
        first = publisher.next_sequence - 1  # the Step's batch
        for _ in range(10):
            sub = Subscriber(publisher)
            sub.connect()
            sub.close()
        assert publisher.next_sequence >= first + 10  # (each answered with a number)
        replayed = list(Subscriber(publisher).replay(first))
        assert [s for s, _ in replayed] == [first]
        assert publisher.dropped_through == -1
    finally:
        srv.stop()


def test_a_batch_that_cannot_be_sent_is_counted_and_the_next_starts_with_a_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch-number reservation cannot be written once (ENOSPC): that batch is
    lost, logged and counted in kvcoord_event_gaps_total{stream="zmq"}, and the
    publisher goes on: the next batch starts with AllBlocksCleared, so a subscriber's
    index holds nothing the pool does not cache. (The thread used to end at the first
    fault, and every later batch queued for it, for good.)"""
    real = kv_publisher.SequenceReservation.allow
    failed: list[int] = []

    def allow(self: kv_publisher.SequenceReservation, seq: int) -> None:
        if not failed and seq > self.start:  # (the subscription's batch goes through)
            failed.append(seq)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, seq)

    monkeypatch.setattr(kv_publisher.SequenceReservation, "allow", allow)
    srv = InProcessServer(POOL, data_dir=str(tmp_path / "data")).start()
    sub = None
    try:
        publisher = srv.running.publishers.publishers["p"]  # type: ignore[union-attr]
        sub = Subscriber(publisher)
        sub.connect()
        rnd = random.Random(3)
        with KVCoordClient(srv.address, timeout=10) as client:
            worker = PoolWorker(client, "p", client.get_pool("p").pool.config, rnd)
            worker.step(_prompt(rnd), None)  # the lost batch
            time.sleep(0.3)
            for _ in range(5):
                worker.step(_prompt(rnd), None)
            sub.drain()
        assert failed
        assert publisher.events_sent, "nothing sent after the fault"
        stored = [b for b in sub.batches if b]
        assert stored[0][0] == ["AllBlocksCleared"]
        assert publisher.batches_lost == 1
        assert not set(sub.index) - set(_cached(srv))
        assert scrape_metrics(srv)[GAPS] == 1
    finally:
        if sub is not None:
            sub.close()
        srv.stop()


def _decl(**kw: Any) -> KVEventsDecl:
    return KVEventsDecl(pool="p", endpoint="tcp://127.0.0.1:*", **kw)


def _stored(i: int, blocks: int) -> BlockStored:
    hashes = tuple(i.to_bytes(4, "big") + b.to_bytes(28, "big") for b in range(blocks))
    return BlockStored(hashes, None, tuple(range(1000, 1000 + 16 * blocks)), 16, None, None)


def test_a_stopped_publisher_drops_and_counts_what_it_is_handed() -> None:
    """Once the publisher's thread has stopped, a batch handed to it is dropped and
    counted, not queued for nobody (the queue used to grow with every Step)."""
    lost: list[str] = []
    publisher = KVEventPublisher(_decl(), on_lost=lost.append)
    publisher.close()
    publisher.submit([_stored(0, 1)])
    publisher.submit([_stored(1, 1)])
    assert (publisher.batches_lost, lost) == (2, ["p", "p"])


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_unread_replays_refer_to_the_buffer_instead_of_copying_it() -> None:
    """20 peers each ask for a replay of a ~10 MB buffer and never read: every answer
    is queued for its peer, referring to the buffered payloads. Copied, each peer held
    a copy of the whole buffer (here +200 MB; 1.37 GB for the reviewer's 30 peers and
    49.5 MB); the bound allows twice the buffer and 30 MB of noise."""
    publisher = KVEventPublisher(_decl(replay_endpoint="tcp://127.0.0.1:*", buffer_steps=100))
    dealers: list[Any] = []
    try:
        for i in range(100):
            publisher.submit([_stored(i, 2000)])
        for _ in range(200):
            if publisher.next_sequence == 100:
                break
            time.sleep(0.05)
        assert publisher.next_sequence == 100
        buffered = publisher.buffered_bytes / 1e6
        assert buffered > 5
        before = _rss_mb()
        ctx = zmq.Context.instance()
        for _ in range(20):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 4096)
            dealer.connect(publisher.replay_endpoint)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            dealers.append(dealer)
        time.sleep(3.0)
        grown = _rss_mb() - before
        assert grown < 2 * buffered + 30, f"RSS grew {grown:.0f} MB for a {buffered:.1f} MB buffer"
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        publisher.close()
