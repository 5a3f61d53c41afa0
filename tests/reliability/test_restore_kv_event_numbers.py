"""The ZMQ KV-events publisher's batch numbers after a restored volume.

Real server process, real files, a real SUB socket. The publisher reserves batch
numbers ahead in ``<data_dir>/kv_events/*.json`` so that a restart never uses a number
twice; that file is restored with the rest of the volume. The server's reservation
step is cut to 2 numbers (a sitecustomize hook) so that a short lost history
publishes past the copy's reservation, as a long one does with the default 4,096.

Before, the restarted publisher started at the copy's ceiling: numbers it had already
published in the lost history named other batches. A vLLM-format subscriber drops a
number it has seen (a replay overlapping the live stream; docs/routing.md), so it
dropped the restored server's batches (their first one's AllBlocksCleared included)
and kept the lost history's blocks: a silently wrong index. Now a restarted publisher
starts past the wall clock in microseconds too, which no earlier process's numbers
can have reached (it would have to publish a million batches a second)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from durable_server import (
    attach,
    copy_volume,
    leased_server,
    restore_volume,
    step_allocate,
    with_sitecustomize,
)
from kvcoord.client import KVCoordClient
from ports import free_port

zmq = pytest.importorskip("zmq")

HOOK = "import kvcoord.service.kv_events_config as c\nc.RESERVE_SEQUENCES = 2\n"


def _numbers(sub: Any, quiet_ms: int = 1500) -> list[int]:
    """Every batch number received until the stream is quiet for ``quiet_ms``."""
    out = []
    for _ in range(10_000):
        if not sub.poll(quiet_ms):
            return out
        _topic, seq, _payload = sub.recv_multipart()
        out.append(int.from_bytes(seq, "big"))
    raise AssertionError("the stream never went quiet")


def _subscriber(endpoint: str) -> Any:
    """A SUB socket bound on ``endpoint`` (loopback): the publisher connects to it (an
    endpoint without a wildcard is connected, vLLM's rule), before and after the restart."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind(endpoint)
    return sub


def test_a_restored_volume_publishes_no_batch_number_twice(tmp_path: Path, monkeypatch: Any) -> None:
    with_sitecustomize(tmp_path, HOOK, monkeypatch)
    lease = 4.0
    server = leased_server(tmp_path, lease, num_blocks=64)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    text = server.config.read_text().replace(
        "enable_caching = true\n", "enable_caching = true\nenable_kv_cache_events = true\n"
    )
    server.config.write_text(text + f'\n[[kv_events]]\npool = "p"\nendpoint = "{endpoint}"\ntopic = "kv"\n')
    sub = _subscriber(endpoint)
    copy = tmp_path / "volume-snapshot"
    try:
        server.start()
        time.sleep(0.5)  # (the subscription reaches the publisher)
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            step_allocate(c, a, "a1", 8)
            _numbers(sub)
            copy_volume(server, copy)
            for i in range(6):  # the lost history: past the copy's reservation
                step_allocate(c, a, f"a{i + 2}", 8)
        seen = _numbers(sub)
        assert seen, "no batch was published"
        published = max(seen)
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address) as c:
            d = attach(c, "worker-d", lease)
            step_allocate(c, d, "d1", 8)
        after = _numbers(sub)
        assert after, "no batch was published after the restore"
        reused = [n for n in after if n <= published]
        assert not reused, (
            f"numbers {reused} were published before the restore (up to {published}) for other batches"
        )
    finally:
        sub.close(linger=0)
        server.stop()
