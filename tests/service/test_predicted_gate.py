"""The predicted mode's sender thread starts on a Step while the model runs (issue 21
item 6): once vLLM's scheduler says the model runs (``StepSender.release``, at each
schedule()'s end), a Step cut at a step's end waits for the next release, unless a
caller waits for it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager
from kvcoord.client.flight import Gate
from kvcoord.client.hashing import BlockHasher
from support import NONE, Req, wire_pool_config


def _admit(m: PredictingKVCacheManager, rid: str, tokens: list[int]) -> None:
    r = Req(rid, tokens)
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)  # type: ignore[attr-defined]
    hit, hit_tokens = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens) - hit_tokens, hit_tokens, hit) is not None


@pytest.fixture
def manager(client: KVCoordClient) -> Any:
    client.create_pool("gated", wire_pool_config(32, events=True))
    m = PredictingKVCacheManager(client, "gated", hash_seed="0", renew=False)
    m.sender.gate.max_seconds = 60  # (never reached: a release or a caller opens it)
    yield m
    m.close()


def test_a_gate_lets_its_waiter_pass_only_once_opened() -> None:
    gate, order = Gate(max_seconds=60), []
    gate.wait()  # never opened for good: passes at once
    gate.open(for_good=True)
    gate.shut()
    waiter = threading.Thread(target=lambda: (gate.wait(), order.append("passed")))
    waiter.start()
    order.append("opening")
    gate.open()
    waiter.join(60)
    assert order == ["opening", "passed"]


def test_a_step_cut_goes_when_the_model_runs_or_when_waited_for(manager: Any) -> None:
    sender, order = manager.sender, []
    checked = sender._checked_step

    def sent(step: Any) -> None:
        order.append("sent")
        checked(step)

    sender._checked_step = sent  # type: ignore[method-assign]
    _admit(manager, "a", list(range(9)))
    manager.take_events()  # no release yet: sent at once
    manager.flush()
    assert order == ["sent"]
    sender.release()  # the scheduler's first schedule() returned
    _admit(manager, "b", list(range(20, 29)))
    manager.take_events()  # the step's end: the Step waits for the model's run
    time.sleep(0.2)
    assert order == ["sent"]
    order.append("model runs")
    sender.release()
    manager.flush()
    assert order == ["sent", "model runs", "sent"]
    _admit(manager, "c", list(range(40, 49)))
    manager.take_events()
    done = threading.Event()
    threading.Thread(target=lambda: (manager.flush(), done.set())).start()
    assert done.wait(30), "a caller waiting for the Step must not wait for the model's run"
    assert order[-1] == "sent" and len(order) == 4
