"""A vLLM 0.33 streaming-input (resumable) session of several chunks on hybrid layouts
(full attention beside a sliding window, or beside a mamba group cached at block
boundaries), on vLLM's real async scheduler: kvcoord's managers (waiting for the pool
and predicted) decide as vLLM's own, and later requests continuing the session's first
prompt, or the whole session, hit as under vLLM.

vLLM's cut (``Scheduler._update_request_as_session``) extends ``prompt_token_ids`` with
the kept outputs and the chunk and sets ``num_prompt_tokens`` to the new length; with
sparse retention (``prefix_cache_retention_interval = 0``, 0.33's default) that length is
the replay boundary a sliding window keeps its tail at and a mamba group checkpoints at.
kvcoord's client sends that length with the sync after the cut, and the pool moves
its replay boundary with it, under dense retention (every block's tail kept) and sparse.
A KV oracle checks both sides: no hit reads KV of another token's. The full-attention-only case is tests/with_vllm/test_streaming_input033.py.

Runs in the vLLM 0.33.0 venv only (``KVCOORD_VLLM_VERSION=0.33.0 scripts/test_vllm.sh``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import SCHEDULERS, V033, kv_cache_config, vllm_config
from kv_oracle import KVOracle
from streaming_support import SteppedScheduler, pool_env_fixture

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (this venv has another release)")

NUM_BLOCKS = 96
PROMPT = [100 + i for i in range(70)]  # 4 blocks and 6 tokens: longer than the window (64)
CHUNKS = [[300 + i for i in range(41)], [500 + i for i in range(37)]]
SAMPLED = 7  # every token the fake model samples
MAX_STEPS = 40

pool_env = pool_env_fixture("streamlay")


def _run(cls: type, layout: str, model_dir: Path) -> tuple[list[Any], dict[str, int]]:
    """The session (the prompt, then each chunk after one sampled token, which the cut
    discards), then requests continuing its first prompt and the whole session: each
    step's decisions and those requests' hits."""
    mamba = "mamba" in layout
    config = vllm_config(
        model_dir, NUM_BLOCKS, async_scheduling=True, mamba_cache_mode="align" if mamba else "none"
    )
    s = SteppedScheduler(cls, config, kv_cache_config(layout, NUM_BLOCKS), SAMPLED)
    oracle = KVOracle(s.sched)  # every hit's KV is its own tokens' (either manager)

    def drain() -> None:
        for _ in range(MAX_STEPS):
            summary = s.step()
            if not summary["total"]:
                return
            decisions.append(summary)
            for rid, _, n, _ in summary["new"]:
                hits.setdefault(rid, n)
        raise AssertionError("the scheduler did not settle")

    decisions: list[Any] = []
    hits: dict[str, int] = {}
    s.add("s", PROMPT, resumable=True)
    for chunk in CHUNKS:
        s.add("s", chunk, resumable=True)  # queued: taken at each stop
    drain()
    assert list(s.sched.requests["s"].all_token_ids)[: len(PROMPT)] == PROMPT
    session = list(s.sched.requests["s"].all_token_ids)
    # a replay of the first prompt (a resend), then one continuing the whole session
    s.add("p", PROMPT + [SAMPLED] + [99] * 20)
    drain()
    s.add("q", session + [98] * 20)
    drain()
    s.add("s", [77] * 9, resumable=True)  # the session goes on
    drain()
    s.add("r", session + [77] * 9 + [97] * 5)
    drain()
    s.sched.shutdown()
    oracle.assert_clean()
    return decisions, hits


#: sparse retention keeps the replay boundary at the prompt's end, which vLLM's cut
#: moves to the session's new length: the sync after the cut carries it
#: (RequestSync.num_prompt_tokens on a registered request), else a later request
#: continuing the session hit less (64 tokens instead of 144) and mamba's block ids
#: differed from the second chunk's allocation on.
LAYOUTS = ["full+swa", "full+mamba-align", "full+swa sparse", "full+mamba-align sparse"]


@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_streaming_session_on_hybrid_layouts_decides_as_vllm(
    layout: str, predict: bool, model_dir: Path, pool_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler

    monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    want, want_hits = _run(SCHEDULERS["async"], layout, model_dir)
    got, hits = _run(KVCoordAsyncScheduler, layout, model_dir)
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert first is None, (first, got[first], want[first])
    assert len(got) == len(want)
    assert hits == want_hits
