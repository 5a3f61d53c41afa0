"""A predicted free lets go of the freed request's records (the engine's, holding its
token list, and the tracker's) off the scheduler's thread: they ride with the Step
(``Gathered.dropped``) and are deallocated on the sender thread as soon as the Step is
answered, while the model runs, not at the next cut (issue 21 item 6, perf9). Real
server, real sender thread."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager
from kvcoord.client.hashing import BlockHasher
from support import NONE, Req, wire_pool_config


@pytest.fixture
def manager(client: KVCoordClient) -> Any:
    client.create_pool("frees", wire_pool_config(32, events=True))
    m = PredictingKVCacheManager(client, "frees", hash_seed="0", renew=False)
    yield m
    m.close()


def test_a_freed_requests_records_go_with_its_step_and_no_further(manager: Any) -> None:
    r = Req("a", list(range(9)))
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(r.all_token_ids)  # type: ignore[attr-defined]
    hit, hit_tokens = manager.get_computed_blocks(r)
    assert manager.allocate_slots(r, 9 - hit_tokens, hit_tokens, hit) is not None
    manager.take_events()
    manager.flush()
    record = manager.mirror.engine.requests["a"]
    manager.free(r)
    assert "a" not in manager.mirror.engine.requests and "a" not in manager.tracker
    dropped = manager.sender.pending.dropped
    assert any(x is record for x in dropped)  # kept for the sender thread
    del dropped
    manager.take_events()  # the step's end: handed to the sender thread
    manager.flush()  # answered (as the model's run would see it)
    assert manager.sender.failure is None
    # nothing holds the records any more: not the Step answered, not the sender
    # thread's loop waiting for the next one (only this test's names and the call's)
    assert sys.getrefcount(record) == 2
