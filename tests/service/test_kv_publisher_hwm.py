"""A ``[[kv_events]]`` subscriber that falls behind: the PUB socket drops what it cannot
take (its high-water mark), and the subscriber must be able to tell, and catch up.

The subscriber is docs/routing.md's (test_kv_publisher_faults.Subscriber): it counts
blocks per hash, replays from its last number plus one on a gap, and applies every
batch numbered above its last. Its socket takes one message at a time and it reads
nothing while the pool churns, so most batches are dropped on the way."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.service.testing import InProcessServer  # noqa: E402
from service.test_kv_publisher_faults import POOL, Subscriber, _cached, _prompt  # noqa: E402
from support import PoolWorker  # noqa: E402


class SlowSubscriber(Subscriber):
    """Holds one message in its socket (RCVHWM 1), the publisher one per peer (hwm 1)."""

    replays: list[int]

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 1)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(self.publisher.endpoint)
        time.sleep(0.3)

    def replay(self, start: int) -> Iterator[tuple[int, bytes]]:
        self.replays.append(start)
        return super().replay(start)


@pytest.mark.parametrize("buffer_steps", [1000, 3])
def test_a_subscriber_behind_the_high_water_mark_sees_the_gap_and_catches_up(buffer_steps: int) -> None:
    """200 Steps while it reads nothing: the batches past the high-water marks are
    dropped; the numbers it then reads show the gap, its replay fills it (every batch
    kept: 1000; the snapshot: 3), and its index equals the pool's map, every hash
    counted as many times as the pool caches it."""
    config = POOL.replace('topic = "kv"', f'topic = "kv"\nbuffer_steps = {buffer_steps}\nhwm = 1')
    srv = InProcessServer(config).start()
    sub = None
    try:
        sub = SlowSubscriber(srv.running.publishers.publishers["p"])  # type: ignore[union-attr]
        sub.replays = []
        sub.connect()
        rnd = random.Random(7)
        with KVCoordClient(srv.address, timeout=10) as client:
            worker = PoolWorker(client, "p", client.get_pool("p").pool.config, rnd)
            for _ in range(200):  # (40 were not always enough to pass the marks on a loaded machine)
                worker.step(_prompt(rnd), None)
        time.sleep(0.5)
        sub.drain()
        assert sub.index == _cached(srv) and sub.index
        assert sub.replays, "nothing was dropped: the test shows nothing"
    finally:
        if sub is not None:
            sub.close()
        srv.stop()
