"""vLLM 0.33.0's engine core and scheduler start on kvcoord, or are refused with the reason.

Runs in the vLLM 0.33.0 venv only (``KVCOORD_VLLM_VERSION=0.33.0 scripts/test_vllm.sh``);
the decisions themselves are compared step by step in test_scheduler_equivalence.py.
"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest
from harness import (
    BLOCK_SIZE,
    SCHEDULERS,
    V033,
    kv_cache_config,
    make_scheduler,
    vllm_config,
    write_deepseek_dir,
)
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from streaming_support import pool_env_fixture

pytestmark = pytest.mark.skipif(not V033, reason="vLLM 0.33.0 only (this venv has another release)")

NUM_BLOCKS = 64


def _kvcoord(kind: str) -> Any:
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    return {"sync": KVCoordScheduler, "async": KVCoordAsyncScheduler}[kind]


pool_env = pool_env_fixture("v033")


@pytest.mark.parametrize("layout", ["full", "full+swa", "mla"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_engine_core_reads_the_manager_as_from_vllms(
    kind: str, layout: str, model_dir: Path, pool_env: str
) -> None:
    """What 0.33's EngineCore reads from the scheduler's manager after building it (the
    effective attention block size, each group's metadata for event consumers) is the
    same on kvcoord as on vLLM's own manager; the pool follows the vllm-0.33 profile."""
    from vllm.v1.engine.core import EngineCore

    answers = []
    if layout == "mla":
        model_dir = write_deepseek_dir(model_dir)  # (use_mla; the group's kind "mla_attention")
    for cls in (SCHEDULERS[kind], _kvcoord(kind)):
        config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=kind == "async")
        sched = make_scheduler(cls, config, kv_cache_config(layout, NUM_BLOCKS))
        core = types.SimpleNamespace(vllm_config=config, scheduler=sched)
        config.cache_config.effective_attention_block_size = -1
        EngineCore._initialize_effective_attention_block_size(core)  # type: ignore[arg-type]
        answers.append(
            (config.cache_config.effective_attention_block_size, EngineCore.get_kv_cache_group_metadata(core))  # type: ignore[arg-type]
        )
        if cls is not SCHEDULERS[kind]:
            assert sched.kv_cache_manager.remote.config.profile == "vllm-0.33"
        sched.shutdown()
    assert answers[0][0] == 16 and answers[0][1], answers
    assert answers[1] == answers[0]


def _group(kind: str) -> Any:
    """A vLLM 0.33 KV cache group spec the plug-in does not take (:func:`_REFUSED`)."""
    import torch
    from vllm.v1 import kv_cache_interface as k

    mla: dict[str, Any] = {"num_kv_heads": 1, "head_size": 48, "dtype": torch.float16}
    return {
        "mla-compressed": lambda: k.MLAAttentionSpec(BLOCK_SIZE, tokens_per_state=4, **mla),
        "mla-deepseek-v4": lambda: k.MLAAttentionSpec(BLOCK_SIZE, model_version="deepseek_v4", **mla),
        "mla-indexer": lambda: k.MLAAttentionSpec(BLOCK_SIZE, cache_role=k.SparseCacheRole.INDEXER, **mla),
        "mla-index-leader": lambda: k.MLAAttentionSpec(BLOCK_SIZE, is_index_group_leader=True, **mla),
        "hidden-state": lambda: k.HiddenStateCacheSpec(BLOCK_SIZE, **mla),
        "swa-mla": lambda: k.SlidingWindowMLASpec(BLOCK_SIZE, sliding_window=64, **mla),
        "cross": lambda: k.CrossAttentionSpec(BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16),
    }[kind]()


#: a group kind (:func:`_group`, beside the "full" layout's group) -> the reason named
_REFUSED = {
    "mla-compressed": "MLA storing one state per 4 tokens",
    "mla-deepseek-v4": "model_version 'deepseek_v4'",
    "mla-indexer": "sparse MLA with an indexer \\(cache_role 'indexer'",
    "mla-index-leader": "sparse MLA with an indexer \\(cache_role 'sparse', is_index_group_leader True",
    "hidden-state": "KV cache group 1 is HiddenStateCacheSpec",
    "swa-mla": "KV cache group 1 is SlidingWindowMLASpec",
    "cross": "KV cache group 1 is CrossAttentionSpec \\(an encoder-decoder model\\)",
}


@pytest.mark.parametrize(
    ("options", "layout", "reason"),
    [
        (
            {"speculative": "eagle", "mamba_cache_mode": "align"},
            "full+mamba-align",
            "EAGLE/MTP with the trailing-block drop .* beside mamba group 1",
        ),
    ]
    + [({"group": kind}, "full", reason) for kind, reason in _REFUSED.items()],
    ids=["eagle-block-drop-beside-mamba", *_REFUSED],
)
def test_what_kvcoord_does_not_reproduce_is_refused_at_start(
    options: dict[str, Any], layout: str, reason: str, model_dir: Path, pool_env: str
) -> None:
    """(EAGLE with 0.33's default look-ahead block hashes runs, and with those hashes
    turned off its trailing-block drop on full attention and windows:
    test_scheduler_equivalence; beside a mamba group the drop moves 0.33's mamba
    checkpoints, which is refused. The watermark, once refused here, runs too:
    test_the_watermark_decides_like_vllm_033. A plain MLA group runs, MTP too:
    test_an_mla_pool_decides_like_vllm_033; what of MLA changes allocation or grouping
    (DeepseekV4's compression and fields, sparse MLA's indexer groups), its subclasses
    and cross-attention groups are refused by name.)"""
    from kvcoord.client.vllm033 import Unsupported033Error
    from vllm.v1 import kv_cache_interface as k

    options = dict(options)
    group = options.pop("group", None)
    config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=False, disable_lookahead=True, **options)
    kv = kv_cache_config(layout, NUM_BLOCKS, 2)
    if group is not None:
        kv.kv_cache_groups.append(k.KVCacheGroupSpec(["model.layers.1.self_attn.attn"], _group(group)))
    with pytest.raises(Unsupported033Error, match=reason):
        make_scheduler(_kvcoord("sync"), config, kv)


def test_context_parallelism_is_refused_at_start(model_dir: Path) -> None:
    """Decode context parallelism (MLA's DCP) scales a sharded group's block under vLLM
    0.33, which the vllm-0.33 profile does not model: named, not answered."""
    from kvcoord.client.vllm033 import unsupported_033

    config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=False)
    kv = kv_cache_config("mla", NUM_BLOCKS)
    assert unsupported_033(kv, config, BLOCK_SIZE) is None
    config.parallel_config.decode_context_parallel_size = 2
    why = unsupported_033(kv, config, BLOCK_SIZE)
    assert why is not None and "decode / prefill context parallelism (2 / 1)" in why, why


@pytest.mark.parametrize("what", ["hisparse", "aux-output"])
def test_what_of_a_kv_connector_kvcoord_does_not_reproduce_is_named(what: str, model_dir: Path) -> None:
    """A KV connector runs on kvcoord under vLLM 0.33 (test_scheduler_equivalence: loads,
    failed loads, delayed and deferred frees); what it does not reproduce is named: the
    load fence of a HiSparse host pool, an auxiliary-output connector's hit cap."""
    from kvcoord.client.vllm033 import unsupported_033

    config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=True, connector="AsyncLoadsConnector")
    kv = kv_cache_config("full", NUM_BLOCKS)
    assert unsupported_033(kv, config, BLOCK_SIZE) is None
    if what == "hisparse":
        kv.hisparse_host_num_blocks = 8
        reason = "HiSparse host pool"
    else:
        config.aux_output_config.enable_return_routed_experts = True
        reason = "auxiliary-output connector"
    why = unsupported_033(kv, config, BLOCK_SIZE)
    assert why is not None and reason in why, why


@pytest.mark.parametrize("layout", ["full+swa", "full+chunked"])
def test_a_kv_connector_with_drafts_beside_a_window_starts(layout: str, model_dir: Path) -> None:
    """A KV connector with drafts beside a sliding-window or chunked-local group is no
    longer refused (it was while its block ids differed: the pool now touches every
    group's hit before any group's external blocks, as vLLM 0.33 does;
    test_scheduler_equivalence compares its decisions)."""
    from kvcoord.client.vllm033 import unsupported_033

    config = vllm_config(
        model_dir,
        NUM_BLOCKS,
        async_scheduling=True,
        connector="AsyncLoadsConnector",
        speculative="draft_model",
    )
    assert unsupported_033(kv_cache_config(layout, NUM_BLOCKS), config, BLOCK_SIZE) is None


def test_periodic_retention_beside_mamba_and_sinks_are_refused_at_start(
    model_dir: Path, pool_env: str
) -> None:
    """A positive prefix_cache_retention_interval runs beside sliding windows
    (test_scheduler_equivalence) but is refused beside a mamba group (periodic mamba
    checkpoints are not reproduced), naming it. Attention sinks: vLLM 0.33.0's own
    manager cannot be built for them (checked here), so the plug-in's scheduler fails at
    start with vLLM's error, and unsupported_033 names why."""
    import torch
    from kvcoord.client.vllm033 import Unsupported033Error, unsupported_033
    from vllm.v1 import kv_cache_interface as k
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=False, mamba_cache_mode="align")
    kv = kv_cache_config("full+mamba-align", NUM_BLOCKS)
    assert unsupported_033(kv, config, BLOCK_SIZE) is None
    kv.prefix_cache_retention_interval = 32
    with pytest.raises(Unsupported033Error, match="prefix_cache_retention_interval 32 beside a mamba group"):
        make_scheduler(_kvcoord("sync"), config, kv)

    sink = k.SinkFullAttentionSpec(BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float16, sink_len=16)
    kv = k.KVCacheConfig(NUM_BLOCKS, [], [k.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], sink)])
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        KVCacheManager(kv, max_model_len=1024, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                       max_in_flight_tokens=256, enable_caching=True)  # fmt: skip
    config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=False)
    why = unsupported_033(kv, config, BLOCK_SIZE)
    assert why is not None and "cannot build its sink manager" in why, why
    # the plug-in fails at start as vLLM's own scheduler does (its base class builds
    # vLLM's manager first): loudly, never scheduling
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        make_scheduler(_kvcoord("sync"), config, kv)


def test_a_pool_of_the_016_profile_is_refused(model_dir: Path, pool_env: str, server: InProcessServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A pool created for vLLM 0.16 workers (same layout) is not attached by a 0.33 engine:
    its hashes and answers would not agree, silently."""
    from kvcoord.client.vllm import PoolMismatchError, pool_config_from_vllm

    config = vllm_config(model_dir, NUM_BLOCKS, async_scheduling=False)
    kv = kv_cache_config("full", NUM_BLOCKS)
    with KVCoordClient(server.address) as c:
        c.create_pool(pool_env, pool_config_from_vllm(kv, config))
    with pytest.raises(PoolMismatchError, match="profile: engine expects 'vllm-0.33', pool has 'vllm-0.16'"):
        make_scheduler(_kvcoord("sync"), config, kv)


@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_resets_priorities_and_salts_decide_like_vllm_033(
    kind: str, predict: bool, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_scheduler_equivalence's resets/priorities/salts/LoRA case without what 0.33
    refuses (prompt embeddings per request, with events on): resets refused and forced,
    preemption by priority, salted requests and LoRA adapters (0.33 names the salt and
    the adapter in BlockStored.extra_keys; the adapter's path is in the hashes vLLM
    computes) all decide and publish as vLLM 0.33's own manager does, waiting for the server or
    predicted (the mirror names the salt too: else its events differ from the server's
    and the session is lost)."""
    from test_scheduler_equivalence import NUM_BLOCKS as BLOCKS
    from test_scheduler_equivalence import first_difference, run_both

    extras = frozenset({"resets", "priority", "salt", "lora"})
    r = run_both(kind, "full", BLOCKS, 23, model_dir, server, monkeypatch, extras=extras, predict=predict)
    assert r.got == r.want, first_difference(r.want, r.got)
    assert r.manager.lost_requests == 0
    assert not predict or r.manager.steps_sent > 20, r.manager
    resets = [entry[2] for entry in r.want if entry[0] == "reset"]
    assert len(resets) >= 10 and any(resets) and not all(resets), resets
    # (0.33 publishes extra keys untagged: a salted first block reads ('a',) or ('b',))
    salted = [e for entry in r.want if entry[0] == "events" for e in entry[1] if "extra_keys=[('" in e]
    assert r.want_counts["preempted"] > 0 and r.want_counts["hit_tokens"] > 0, r.want_counts
    assert salted, "no BlockStored named a cache salt"
    adapters = [e for entry in r.want if entry[0] == "events" for e in entry[1] if "lora_name='adapter-" in e]
    assert adapters, "no BlockStored named a LoRA adapter"


@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
def test_prompt_embeddings_publish_vllm_033s_extra_keys(
    predict: bool, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With KV events on, prompts given as embeddings (0.33 publishes each block's
    prompt-embeds digest in BlockStored.extra_keys; before, kvcoord refused them when
    scheduled): the client registers the digests with the request, and the pool (and
    the predicting mirror) publish them as vLLM 0.33's own manager does."""
    from test_scheduler_equivalence import NUM_BLOCKS as BLOCKS
    from test_scheduler_equivalence import first_difference, run_both

    r = run_both(
        "sync",
        "full",
        BLOCKS,
        24,
        model_dir,
        server,
        monkeypatch,
        extras=frozenset({"embeds"}),
        predict=predict,
    )
    assert r.got == r.want, first_difference(r.want, r.got)
    assert r.manager.lost_requests == 0
    digests = [e for entry in r.want if entry[0] == "events" for e in entry[1] if "extra_keys=[(b'" in e]
    assert digests, "no BlockStored named a prompt-embeds digest"


@pytest.mark.parametrize("predict", [False, True], ids=["waiting", "predicted"])
@pytest.mark.parametrize("layout", ["full", "full+swa"])
def test_full_report_mode_requests_publish_as_vllm_033(
    layout: str, predict: bool, model_dir: Path, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests asking for ``kv_cache_report_mode = "full"`` (two in five), KV events on:
    vLLM 0.33's manager re-announces each hit they look up (a BlockStored per group from
    block 0, no parent). The plug-in registers the mode with the request (before, it
    refused such a request when scheduled) and the pool, waiting or predicted (the
    mirror re-announces too: else its events differ from the server's and the session
    is lost), publishes as vLLM 0.33's own manager does."""
    from test_scheduler_equivalence import NUM_BLOCKS as BLOCKS
    from test_scheduler_equivalence import first_difference, run_both

    r = run_both("sync", layout, BLOCKS, 25, model_dir, server, monkeypatch, extras=frozenset({"report"}),
                 predict=predict)  # fmt: skip
    assert r.got == r.want, first_difference(r.want, r.got)
    assert r.manager.lost_requests == 0
    # a re-announcement: a store from block 0 of a hash still cached in its group
    cached: set[tuple[str, str]] = set()
    re_announced = 0
    for entry in r.want:
        for e in entry[1] if entry[0] == "events" else ():
            found = re.search(r"block_hashes=\[([^]]*)\].*group_idx=(\d+)", e)
            if found is None:
                continue
            hashes, group = found.group(1).split(", "), found.group(2)
            if e.startswith("BlockRemoved"):
                cached.difference_update((h, group) for h in hashes)
                continue
            if "parent_block_hash=None" in e and (hashes[0], group) in cached:
                re_announced += 1
            cached.update((h, group) for h in hashes)
    assert r.want_counts["hit_tokens"] > 0 and re_announced > 20, (r.want_counts, re_announced)


def test_multi_module_mtp_beside_a_kv_connector_is_refused(model_dir: Path) -> None:
    """Multi-module MTP (two MTP layers, two drafts: a prefill look-ahead of 2) runs on its
    look-ahead hashes (test_an_mla_pool_decides_like_vllm_033: the pool caches up to
    computed - 1, vLLM 0.33's re-prefillable tail); beside a KV connector vLLM keeps the
    legacy hashes but still holds back that tail, which the pool cannot know: named."""
    from kvcoord.client.vllm033 import unsupported_033

    deepseek = write_deepseek_dir(model_dir, 2)
    kv = kv_cache_config("mla", NUM_BLOCKS)
    config = vllm_config(deepseek, NUM_BLOCKS, async_scheduling=False, speculative="mtp")
    assert unsupported_033(kv, config, BLOCK_SIZE) is None
    config = vllm_config(deepseek, NUM_BLOCKS, async_scheduling=False, speculative="mtp",
                         connector="LoadedHalfConnector")  # fmt: skip
    why = unsupported_033(kv, config, BLOCK_SIZE)
    assert why is not None and "multi-module MTP (a prefill look-ahead of 2 tokens)" in why, why
