"""HIT_BLOCK_TAKEN (vLLM 0.16) and UNCOUNTED_BLOCKS (0.16 and 0.33) under vLLM's own
scheduler on kvcoord, with a KV connector that has one token of a request loaded
elsewhere: ``schedule()`` raises the typed refusal (FailedPreconditionError, with its
reason) to its caller, as vLLM's own scheduler raises its ValueError there. The step
it was cut short in had already decoded a running request; once the scheduler's
requests are finished, the server holds nothing: every block free, no request left,
CheckPool clean (in the waiting mode and the predicted one; the predicted mirror's
free count is the server's).

The scenarios are the engine's (tests/unit/test_hit_block_taken.py's sliding window
first; tests/service/test_mamba_external_wire.py's 6 blocks needed where 5 are free)
scaled to the scheduler's 16-token blocks.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import harness
import pytest
import torch
from harness import (
    BLOCK_SIZE,
    V033,
    LoadedHalfConnector,
    fake_runner_output,
    kv_cache_config,
    make_scheduler,
    vllm_config,
)
from kvcoord.client import FailedPreconditionError, KVCoordClient
from kvcoord.client.vllm_scheduler import KVCoordScheduler
from kvcoord.service.testing import InProcessServer
from shared_blocks import watch_shared_blocks
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1 import kv_cache_interface as k
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

_pools = itertools.count()


class TokensLoaded(LoadedHalfConnector):
    """A KV connector that has the first ``count`` tokens of every request whose id
    starts with "x" loaded elsewhere (synchronously), and nothing of any other request."""

    count = 1

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not request.request_id.startswith("x"):
            return 0, False
        return max(0, self.count - num_computed_tokens), False


def _scheduler(
    server: InProcessServer, model_dir: Path, monkeypatch: pytest.MonkeyPatch, run: str,
    kv_config: k.KVCacheConfig, mamba: bool,
) -> tuple[Any, str]:  # fmt: skip
    """``run``: "vllm" (vLLM's own Scheduler and manager), "waiting" or "predicted"
    (KVCoordScheduler on a new pool, in that mode)."""
    predict = run == "predicted"
    pool = f"refusal-{next(_pools)}"
    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", pool)
    monkeypatch.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    monkeypatch.setattr(harness, "TokensLoaded", TokensLoaded, raising=False)  # (vllm_config's module)
    config = vllm_config(
        model_dir, kv_config.num_blocks, async_scheduling=False, connector="TokensLoaded",
        mamba_cache_mode="align" if mamba else "none",
    )  # fmt: skip
    return make_scheduler(Scheduler if run == "vllm" else KVCoordScheduler, config, kv_config), pool


def _add(sched: Any, rid: str, prompt: list[int], max_tokens: int) -> None:
    hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    block = int(sched.hash_block_size) if V033 else BLOCK_SIZE
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    extra: dict[str, Any] = {} if V033 else {"eos_token_id": None}
    sched.add_request(
        Request(rid, prompt, params, None, block_hasher=get_request_block_hasher(block, hash_fn), **extra)
    )


def _step(sched: Any) -> Any:
    out = sched.schedule()
    sched.update_from_output(out, fake_runner_output(sched, out))
    return out


def _refused(sched: Any, reason: str) -> None:
    """The next schedule() raises the typed refusal (the running requests' decodes in
    it came first)."""
    with pytest.raises(FailedPreconditionError) as err:
        sched.schedule()
    assert err.value.reason == reason, err.value
    assert "request 'x" in err.value.message


def _nothing_left(sched: Any, server: InProcessServer, pool: str, predict: bool) -> None:
    """The refused request aborted, the scheduler goes on: the running requests are
    scheduled again, their tables the server's. Then every request finished: the server
    holds nothing and every block is free."""
    refused = [rid for rid in sched.requests if rid.startswith("x")]
    sched.finish_requests(refused, RequestStatus.FINISHED_ABORTED)
    running = sorted(r.request_id for r in sched.running)
    assert running and sorted(_step(sched).num_scheduled_tokens) == running
    manager = sched.kv_cache_manager.remote
    manager.flush()
    with KVCoordClient(server.address, timeout=10) as c:
        held = {
            r.request_id: [list(g.block_ids) for g in r.groups]
            for r in c.inspect_pool(pool, all_requests=True).requests
        }
    assert held == {rid: [list(g) for g in manager.get_block_ids(rid)] for rid in running}
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    manager.flush()
    with KVCoordClient(server.address, timeout=10) as c:
        state = c.inspect_pool(pool, all_requests=True)
        assert [r.request_id for r in state.requests] == []
        assert state.num_free_blocks == c.get_pool(pool).pool.config.num_blocks - 1
        assert list(c.check_pool(pool).violations) == []
        if predict:
            assert manager.mirror.num_free_blocks == state.num_free_blocks
    assert manager.lost_requests == 0
    sched.shutdown()


RUNS = ["vllm", "waiting", "predicted"]


@pytest.mark.parametrize("run", RUNS)
def test_uncounted_blocks_reach_the_caller_of_schedule_and_leave_nothing_held(
    run: str, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(full, mamba align): "h1" (3 tokens) runs; "x2", its prompt but the last token
    loaded by the connector, would take a block more than vLLM counts, which is every
    free block. vLLM 0.33 (7 blocks, a 33-token prompt): schedule() raises the refusal
    on kvcoord, vLLM's own manager its ValueError half way. vLLM 0.16 (8 blocks, 49
    tokens, 1 loaded) never gets that far: its scheduler asserts, before allocating,
    that a mamba ``align`` group meets no external tokens ("External KV connector is
    not verified yet"); so the refusal is checked one level down, on the scheduler's
    own kvcoord manager, with the call the scheduler would make."""
    monkeypatch.setattr(TokensLoaded, "count", 32 if V033 else 1)
    blocks, length = (7, 33) if V033 else (8, 49)
    sched, pool = _scheduler(
        server, model_dir, monkeypatch, run, kv_cache_config("full+mamba-align", blocks), mamba=True
    )
    _add(sched, "h1", [5, 6, 7], 100)
    assert list(_step(sched).num_scheduled_tokens) == ["h1"]
    prompt = list(range(100, 100 + length))
    _add(sched, "x2", prompt, 4)
    if not V033:
        with pytest.raises(AssertionError, match="External KV connector is not verified yet"):
            sched.schedule()
        if run == "vllm":
            return
        manager, request = sched.kv_cache_manager, sched.requests["x2"]
        hit, hit_tokens = manager.get_computed_blocks(request)
        assert hit_tokens == 0
        with pytest.raises(FailedPreconditionError) as err:
            manager.allocate_slots(request, length - 1, 0, hit, num_external_computed_tokens=1)
        assert err.value.reason == "UNCOUNTED_BLOCKS"
    elif run == "vllm":
        with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
            sched.schedule()
        return
    else:
        _refused(sched, "UNCOUNTED_BLOCKS")
    _nothing_left(sched, server, pool, run == "predicted")


def _window_first(num_blocks: int) -> k.KVCacheConfig:
    """A sliding-window group (window 64) before a full attention group."""
    common: dict[str, Any] = {"num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
    groups = [
        k.KVCacheGroupSpec(
            ["model.layers.1.self_attn.attn"], k.SlidingWindowSpec(BLOCK_SIZE, sliding_window=64, **common)
        ),
        k.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], k.FullAttentionSpec(BLOCK_SIZE, **common)),
    ]
    return k.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.skipif(V033, reason="vLLM 0.33 touches every group's hit first: never HIT_BLOCK_TAKEN")
@pytest.mark.parametrize("run", RUNS)
def test_hit_block_taken_reaches_the_caller_of_schedule_and_leaves_nothing_held(
    run: str, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(sliding window, full), 13 blocks: "p0" (32 tokens) finishes (its blocks back to
    the free queue, group by group, last first: [S1, S0, F1, F0]); four holders take the
    never-used blocks, two of them finish; "x7" (the same 32 tokens and 20 more, its
    next token loaded by the connector) hits both groups' two blocks, and the window
    group would take the full group's hit block F1, at the queue's head, for it."""
    sched, pool = _scheduler(server, model_dir, monkeypatch, run, _window_first(13), mamba=False)
    sharers = watch_shared_blocks(sched.kv_cache_manager) if run == "vllm" else []
    prefix = list(range(200, 232))
    _add(sched, "p0", prefix, 1)
    _step(sched)
    assert "p0" not in sched.requests
    for n in range(1, 5):
        _add(sched, f"h{n}", [300 + n, 400 + n, 500 + n], 100)
    _step(sched)
    sched.finish_requests(["h1", "h2"], RequestStatus.FINISHED_ABORTED)
    monkeypatch.setattr(TokensLoaded, "count", 33)
    _add(sched, "x7", prefix + list(range(600, 620)), 4)
    if run == "vllm":  # vLLM 0.16's own manager puts a block in both groups' tables of x7
        sched.schedule()
        assert sharers == ["x7"]
        return
    _refused(sched, "HIT_BLOCK_TAKEN")
    _nothing_left(sched, server, pool, run == "predicted")
