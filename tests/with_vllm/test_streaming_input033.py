"""A vLLM 0.33 streaming-input (resumable) session on vLLM's real async scheduler:
kvcoord's managers (waiting for the pool and predicted) decide as vLLM's own.

The session's prompt is one token short of a block; its first sampled token fills the
block, and ``update_from_output`` caches the request's blocks before the stop is handled
(async scheduling: ``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)``),
so kvcoord's manager syncs that token and the block's hash. The stop then takes the
queued next chunk: ``_update_request_as_session`` discards the sampled token in place
and appends the chunk. vLLM's manager caches the block under the chunk's hash once the
session resumes: a later prompt that continues with the discarded token has no hit. The
old code cached it under the discarded token's hash (a 16-token hit on KV of another
token, no error anywhere) when waiting for the pool; the predicted manager syncs there
only when a block was cached, so this flow does not reach it (its case, with accepted
drafts, is tests/service/test_resumable_token_discard.py) and is compared all the same.

Runs in the vLLM 0.33.0 venv only (``KVCOORD_VLLM_VERSION=0.33.0 scripts/test_vllm.sh``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import BLOCK_SIZE, SCHEDULERS, V033, kv_cache_config, vllm_config
from streaming_support import SteppedScheduler, pool_env_fixture

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (this venv has another release)")

NUM_BLOCKS = 32
PROMPT = [100 + i for i in range(BLOCK_SIZE - 1)]
SAMPLED = 7  # every token the fake model samples
CHUNK = [50, 51, 52]

pool_env = pool_env_fixture("stream")


def _run(cls: type, model_dir: Path) -> tuple[list[Any], int]:
    """The session (prompt, one sampled token, the next chunk), then a prompt continuing
    with the discarded token: each step's decisions and that prompt's hit."""
    config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=True)
    s = SteppedScheduler(cls, config, kv_cache_config("full", NUM_BLOCKS), SAMPLED)
    decisions = []
    s.add("s", PROMPT, resumable=True)
    s.add("s", CHUNK, resumable=True)  # queued: taken at the stop
    decisions.append(s.step())  # the prompt computed, SAMPLED sampled: the stop takes the chunk
    assert list(s.sched.requests["s"].all_token_ids) == PROMPT + CHUNK  # (SAMPLED discarded)
    decisions.append(s.step())  # the session resumes on its blocks: the chunk computed
    s.add("q", PROMPT + [SAMPLED] + [99] * 4)
    summary = s.step()
    decisions.append(summary)
    hit = next(n for rid, _, n, _ in summary["new"] if rid == "q")
    s.sched.shutdown()
    return decisions, hit


@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
def test_a_discarded_streaming_token_leaves_no_hit_as_under_vllm(
    predict: bool, model_dir: Path, pool_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler

    monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    want, want_hit = _run(SCHEDULERS["async"], model_dir)
    assert want_hit == 0  # vLLM's own manager: block 0 holds the chunk's first token
    got, hit = _run(KVCoordAsyncScheduler, model_dir)
    assert hit == want_hit
    assert got == want
