"""Drive vLLM's real Scheduler / AsyncScheduler (0.16.0 or 0.33.0, whichever the venv
has: ``VLLM_VERSION``) through a seeded workload.

A model directory with only a tiny ``config.json`` (no weights, no tokenizer), CPU
device, and a ``KVCacheConfig`` built here as the engine core would after profiling. The
fake model runner samples one token for every scheduled request that is past its prompt
(``request.is_prefill_chunk`` false), as vLLM's runner does. Every observable decision is
recorded per step, so two runs (vLLM's in-process manager, kvcoord) compare step by step.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import random
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1 import kv_cache_interface as k
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.serial_utils import MsgpackEncoder
from vllm.v1.structured_output import StructuredOutputManager

#: the vLLM release of this venv (scripts/install_vllm.sh makes one per release)
VLLM_VERSION = importlib.metadata.version("vllm")
V033 = VLLM_VERSION.startswith("0.33.")

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
VOCAB = 1000
#: layout name -> KV cache group specs (vLLM's); "full+swa" is a hybrid (two groups);
#: "full+mamba" / "full+mamba-align" (not in LAYOUTS) add a mamba group instead, its
#: state cached not at all / at block boundaries (vLLM's mamba_cache_mode), and
#: "full+chunked" a chunked local attention group (chunks of 64 tokens); "mla" (vLLM
#: 0.33, not in LAYOUTS) is one MLAAttentionSpec group, as DeepSeek V2/V3/R1 and Kimi K2
#: have, for the model of :func:`write_deepseek_dir` ("mla-mtp2": of two MTP layers)
LAYOUTS = ("full", "full+swa")


def write_model_dir(path: Path) -> Path:
    """A Mistral-shaped model of two layers: only what ModelConfig inspects."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "head_dim": 16, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "sliding_window": None, "torch_dtype": "float16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def write_deepseek_dir(model_dir: Path, mtp_layers: int = 1) -> Path:
    """A DeepSeek-V3-shaped model of two layers beside ``model_dir`` (MLA: vLLM's
    ``use_mla``; ``mtp_layers`` MTP layers, ``num_nextn_predict_layers``: with two, MTP
    of two drafts is multi-module, its look-ahead two tokens): only what ModelConfig and
    an MTP SpeculativeConfig inspect."""
    path = model_dir.parent / f"{model_dir.name}-deepseek{mtp_layers}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "torch_dtype": "float16", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": mtp_layers,
        "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "tie_word_embeddings": False, "rope_scaling": None,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def write_eagle_dir(model_dir: Path) -> Path:
    """An EAGLE draft head's config beside the model's: its shape, Llama-typed, one layer."""
    path = model_dir.parent / f"{model_dir.name}-eagle"
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def kv_cache_config(layout: str, num_blocks: int, num_speculative_blocks: int = 0) -> k.KVCacheConfig:
    """The engine's KVCacheConfig for ``layout`` (as get_kv_cache_configs would group it;
    a mamba group has ``num_speculative_blocks``, which vLLM sets to the draft token
    count when speculative decoding is on). ``swa``: one sliding-window group alone. A
    suffix (vLLM 0.33) sets ``prefix_cache_retention_interval``: `` rN`` to N, `` sparse``
    to 0 (what EngineCore copies from 0.33's CacheConfig by default); without one it
    keeps KVCacheConfig's own default, None (dense). `` mixed`` gives the last group a
    bfloat16 KV cache beside the others' float16: a mixed-precision KV cache, for which
    vLLM 0.33 zeroes new blocks (``needs_kv_cache_zeroing``). `` mtp`` flags the first
    group ``is_eagle_group`` (it holds the MTP layer, as vLLM 0.33's planner marks it)."""
    layout, *options = layout.split(" ")
    mixed = "mixed" in options
    retention = next((o for o in options if o not in ("mixed", "mtp")), "")
    common: dict[str, Any] = {"num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
    groups = [
        k.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], k.FullAttentionSpec(BLOCK_SIZE, **common))
    ]
    if layout.startswith("mla"):  # ("mla-mtp2" too; a latent vector, kv_lora_rank + qk_rope_head_dim)
        mla = k.MLAAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_size=48, dtype=torch.float16)
        groups = [k.KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], mla)]
    if layout == "swa":
        groups = []
        layout = "full+swa"
    if layout == "full+chunked":
        groups.append(
            k.KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"],
                k.ChunkedLocalAttentionSpec(BLOCK_SIZE, attention_chunk_size=64, **common),
            )
        )
    if layout.startswith("full+mamba"):
        mode = "align" if layout.endswith("align") else "none"
        groups.append(
            k.KVCacheGroupSpec(
                ["model.layers.1.mixer"],
                k.MambaSpec(
                    block_size=BLOCK_SIZE if mode == "align" else MAX_MODEL_LEN, shapes=((2, 16), (4, 8)),
                    dtypes=(torch.float16, torch.float16), mamba_cache_mode=mode,
                    num_speculative_blocks=num_speculative_blocks,
                    # vLLM 0.33's Mamba2 layers: one prefill checkpoint block, alignment 1
                    **({"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
                       if "ckpt" in layout else {}),
                ),
            )
        )  # fmt: skip
    if layout == "full+full32":  # (vLLM 0.33: hashes of 16 tokens, hits and caching at 32)
        groups.append(
            k.KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"], k.FullAttentionSpec(2 * BLOCK_SIZE, **common)
            )
        )
    if layout == "full+swa32":
        groups.append(
            k.KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"],
                k.SlidingWindowSpec(2 * BLOCK_SIZE, sliding_window=128, **common),
            )
        )
    if layout == "full+swa":
        groups.append(
            k.KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"],
                k.SlidingWindowSpec(BLOCK_SIZE, sliding_window=64, **common),
            )
        )
    if "mtp" in options:  # the group of the MTP layer, as vLLM's planner flags it (0.33)
        groups[0] = dataclasses.replace(groups[0], is_eagle_group=True)
    if mixed:
        groups[-1] = dataclasses.replace(
            groups[-1], kv_cache_spec=dataclasses.replace(groups[-1].kv_cache_spec, dtype=torch.bfloat16)
        )
    config = k.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    if retention:
        config.prefix_cache_retention_interval = 0 if retention == "sparse" else int(retention.lstrip("r"))
    return config


def vllm_config(
    model_dir: Path,
    num_blocks: int,
    *,
    async_scheduling: bool,
    enable_caching: bool = True,
    events: bool = True,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    connector: str | None = None,
    load_failure_policy: str = "recompute",
    speculative: str | None = None,
    policy: str = "fcfs",
    lora: bool = False,
    mamba_cache_mode: str = "none",
    prompt_embeds: bool = False,
    watermark: float = 0.0,
    disable_lookahead: bool = False,
) -> VllmConfig:
    """``speculative``: "ngram" (3 drafts a step, no lookahead slots), "draft_model"
    (2 drafts, and 2 lookahead slots in every allocation, as a draft model needs; the
    draft model is this same weightless model) or "eagle" (the same, and prefix hits
    drop their last block, as vLLM's manager does for EAGLE; a one-layer Llama-shaped
    draft config beside the model) or "mtp" (2 drafts from the model's own MTP layer:
    ``model_dir`` of :func:`write_deepseek_dir`). ``watermark``: the scheduler's (vLLM 0.24+).
    ``disable_lookahead``: (vLLM 0.33) ``speculative_config.disable_lookahead_block_hashes``:
    EAGLE keeps the legacy hashes and the trailing-block drop."""
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float16",
        enable_prompt_embeds=prompt_embeds,
    )  # fmt: skip
    spec = None
    if speculative is not None:
        draft = {"draft_model": str(model_dir), "eagle": str(write_eagle_dir(model_dir))}
        spec = SpeculativeConfig(
            method=speculative, model=draft.get(speculative),
            num_speculative_tokens=3 if speculative == "ngram" else 2, prompt_lookup_max=4, prompt_lookup_min=2,
            target_model_config=model, target_parallel_config=ParallelConfig(distributed_executor_backend="uni"),
            **({"disable_lookahead_block_hashes": True} if disable_lookahead else {}),
        )  # fmt: skip
    cache = CacheConfig(
        block_size=BLOCK_SIZE, enable_prefix_caching=enable_caching, mamba_cache_mode=mamba_cache_mode
    )
    cache.num_gpu_blocks = num_blocks
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        policy=policy,
    )
    if watermark:
        sched.watermark = watermark
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(distributed_executor_backend="uni"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null") if events else None,
        speculative_config=spec,
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=8) if lora else None,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path="harness",
            kv_role="kv_both",
            kv_load_failure_policy=load_failure_policy,
        )
        if connector
        else None,
    )


class LoadedHalfConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV connector, scheduler side, as on a disaggregated decode instance: for two
    requests in three, the first half of the prompt is already loaded elsewhere
    (``num_external_computed_tokens``), synchronously. The worker side does nothing.
    It takes every group's table (``SupportsHMA``), so hybrid layouts run with it."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if int(request.request_id[1:]) % 3 == 0:
            return 0, False
        return max(0, (request.num_prompt_tokens - 1) // 2 - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def worker_output(self) -> KVConnectorOutput | None:
        """What the worker side reports with the next model output."""
        return None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class AsyncLoadsConnector(LoadedHalfConnector):
    """Also the asynchronous side of a KV connector, as NIXL's on a P/D pair: one
    request in three loads half of its prompt asynchronously (``load_kv_async``: the
    scheduler allocates with ``delay_cache_blocks`` and parks it in
    WAITING_FOR_REMOTE_KVS until the worker reports the load finished, one step later);
    a finished request in five that holds blocks keeps them while its KV is sent
    (``request_finished`` delays the free until the worker reports it sent)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loading: set[str] = set()  # allocated for an asynchronous load, not reported yet
        self.receiving: set[str] = set()  # loads the next output reports finished
        self.sending: set[str] = set()  # sends the next output reports finished
        self.counts = {"async loads": 0, "delayed frees": 0}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if int(request.request_id[1:]) % 3 != 1:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        n = max(0, (request.num_prompt_tokens - 1) // 2 - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens and int(request.request_id[1:]) % 3 == 1:
            self.loading.add(request.request_id)
            self.receiving.add(request.request_id)
            self.counts["async loads"] += 1

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or rid in self.loading or not block_ids:
            return False, None  # only a request that ran to its end sends its KV
        if int(rid[1:]) % 5:
            return False, None
        self.sending.add(rid)
        self.counts["delayed frees"] += 1
        return True, None

    def worker_output(self) -> KVConnectorOutput | None:
        if not self.receiving and not self.sending:
            return None
        out = KVConnectorOutput(finished_recving=set(self.receiving), finished_sending=set(self.sending))
        self.loading -= self.receiving
        self.receiving.clear()
        self.sending.clear()
        return out


def block_sizes(config: VllmConfig, kv_config: k.KVCacheConfig) -> tuple[int, int]:
    """The scheduler block size and hash block size EngineCore gives the scheduler: under
    vLLM 0.16.0 the cache block size; under 0.33.0 resolved from the groups (the LCM of
    their block sizes; a mamba group outside "align" mode makes it its own size)."""
    if not V033:
        return BLOCK_SIZE, BLOCK_SIZE
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    return int(scheduler_block_size), int(hash_block_size)


def make_scheduler(cls: type[Scheduler], config: VllmConfig, kv_config: k.KVCacheConfig) -> Scheduler:
    """As vLLM's EngineCore builds it (log_stats on)."""
    scheduler_block_size, hash_block_size = block_sizes(config, kv_config)
    return cls(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block_size,
        log_stats=True,
        **({"hash_block_size": hash_block_size} if V033 else {}),
    )


class Recorder:
    """Captures KV event batches the scheduler publishes."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


def _new_data(out: SchedulerOutput) -> list[Any]:
    return [
        (r.req_id, r.block_ids, r.num_computed_tokens, len(r.prompt_token_ids or ()))
        for r in out.scheduled_new_reqs
    ]


def summarize(out: SchedulerOutput) -> dict[str, Any]:
    c = out.scheduled_cached_reqs
    return {
        "num_scheduled_tokens": dict(sorted(out.num_scheduled_tokens.items())),
        "total": out.total_num_scheduled_tokens,
        "new": _new_data(out),
        "cached": list(zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True)),
        "resumed": sorted(c.resumed_req_ids),
        "preempted": sorted(out.preempted_req_ids or ()),
        "finished": sorted(out.finished_req_ids),
        "common_prefix": list(out.num_common_prefix_blocks),
        "drafts": {r: list(t) for r, t in sorted(out.scheduled_spec_decode_tokens.items())},
        # (vLLM 0.33: the blocks the worker zeroes, take_new_block_ids)
        "zero": getattr(out, "new_block_ids_to_zero", None),
    }


def summarize_outputs(outs: dict[int, EngineCoreOutputs]) -> dict[str, Any]:
    got: dict[str, Any] = {}
    for eco in outs.values():
        for o in eco.outputs:
            # (0.33 reports the prompt's cached tokens in prefill_stats)
            cached = repr(o.prefill_stats) if V033 else o.num_cached_tokens
            got[o.request_id] = (list(o.new_token_ids), str(o.finish_reason), cached)
        s = eco.scheduler_stats
        if s is not None:
            p = s.prefix_cache_stats
            got["~stats"] = (
                s.num_running_reqs, s.num_waiting_reqs, round(s.kv_cache_usage, 9),
                (p.reset, p.requests, p.queries, p.hits, p.preempted_requests, p.preempted_queries, p.preempted_hits),
            )  # fmt: skip
    return dict(sorted(got.items()))


def fake_runner_output(sched: Scheduler, out: SchedulerOutput, positional: bool = False) -> ModelRunnerOutput:
    """One sampled token per request past its prompt (deterministic in id and length),
    after the scheduled drafts it accepts: a prefix of them, of a length deterministic in
    id and length (all, some or none).

    With ``positional`` the token depends on the request and the position it is sampled
    for only, as a deterministic model's would: the same whenever and however often the
    request is scheduled (recomputed after a preemption, or scheduled before the previous
    output is applied), so two runs that schedule differently give each request the same
    tokens. (Without it, the token depends on the outputs applied so far, which the
    async scheduler's overlap makes lag: only runs that schedule alike agree.)"""
    ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    drafts = out.scheduled_spec_decode_tokens
    for rid in ids:
        req = sched.requests.get(rid)
        if req is None or req.is_prefill_chunk:
            sampled.append([])
        else:
            # (with the async scheduler the drafts are placeholders the worker fills: any
            # token values do, the scheduler only counts how many were accepted)
            accepted = (int(rid[1:]) + req.num_output_tokens) % (len(drafts.get(rid, ())) + 1)
            at = req.num_output_tokens
            if positional:  # the index among its outputs of the token sampled in this step
                at = req.num_computed_tokens - len(drafts.get(rid, ())) - req.num_prompt_tokens
            sampled.append([(int(rid[1:]) * 7919 + (at + j) * 31 + 7) % VOCAB for j in range(accepted + 1)])
    connector = getattr(sched, "connector", None)
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
        kv_connector_output=connector.worker_output() if connector is not None else None,
    )  # fmt: skip


def run_workload(
    sched: Scheduler,
    *,
    seed: int,
    steps: int,
    async_overlap: bool,
    on_step: Callable[[int], None] | None = None,
    extras: frozenset[str] = frozenset(),
    queue_depth: int = 1,
    aborts: bool = True,
    drain: bool = False,
    positional: bool = False,
    trace: list[Any] | None = None,
) -> tuple[list[Any], dict[str, int]]:
    """Run ``steps`` engine steps; returns the per-step record and event/outcome counts.
    ``trace``: the list the record is appended to as the run goes (what a run that
    raised had decided until then).

    With ``async_overlap`` the next step is scheduled before the previous one's output
    is applied, as vLLM's engine core does with async scheduling (a batch queue of one);
    ``queue_depth`` 2 keeps two steps' outputs pending, as its batch queue does with two
    pipeline-parallel stages.
    ``extras`` (drawn from their own random stream, so the base workload is the same):
    "resets" (every 25 steps ``reset_prefix_cache``, alternately refused while blocks
    are held and forced by preempting every running request), "priority" (requests of
    priority 0-2, for a scheduler with the priority policy) and "salt" (one request in
    three with one of two cache salts, which keep their hits apart) and "lora" (half the
    requests with one of three LoRA adapters, two at most per step, for a scheduler
    with a LoRA config; an adapter's blocks hash apart and its events name it) and
    "embeds" (one request in four given as prompt embeddings, no token ids, for a
    model config that enables them; two shared embedding prefixes give hits) and
    "report" (two requests in five with vLLM 0.26+'s ``kv_cache_report_mode = "full"``:
    with events on, their hits are re-announced) and "junctions" (shared prefixes of
    48, 80, 112 and 170 tokens, three prompts in ten a prefix and one token: their last
    hash boundaries, keyed, end inside 32-token blocks, so that siblings meet
    shared-prefix junctions there).
    Without ``aborts`` no request is aborted (which ones are depends on the requests
    still live, so on scheduling); with ``drain`` the run goes on past ``steps``,
    adding nothing, until every request finished (at most 2,000 more steps);
    ``positional``: see :func:`fake_runner_output`.
    """
    # as EngineCore does: the configured hash (vLLM's default sha256), NONE_HASH from PYTHONHASHSEED
    hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    # (vLLM 0.33's engine core also passes the look-ahead tokens each hash covers: EAGLE/MTP)
    lookahead = int(getattr(sched.vllm_config, "num_hash_lookahead_tokens", 0) or 0) if V033 else 0
    hash_block_size = int(sched.hash_block_size) if V033 else BLOCK_SIZE  # (0.33: as EngineCore resolves it)
    hasher = get_request_block_hasher(hash_block_size, hash_fn, *((lookahead,) if lookahead else ()))
    recorder = Recorder()
    sched.kv_event_publisher = recorder  # type: ignore[assignment]
    encoder = MsgpackEncoder()
    rnd = random.Random(seed)
    lengths = (48, 80, 112, 170) if "junctions" in extras else (16, 40, 100, 170)
    prefixes = [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]
    trace = [] if trace is None else trace
    counts = {
        "preempted": 0,
        "aborted": 0,
        "finished": 0,
        "hit_tokens": 0,
        "events": 0,
        "scheduled": 0,
        "zeroed": 0,
    }
    pending: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    nid = 0
    extra_rnd = random.Random(seed * 31 + 7)
    embed_gen = torch.Generator().manual_seed(seed)
    embed_prefixes = [torch.randn(n, 64, generator=embed_gen) for n in (32, 48)]

    def apply(out: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        outs = sched.update_from_output(out, mro)
        if sched.num_spec_tokens and not async_overlap:
            # the drafter proposes the next drafts of every running request (the async
            # scheduler schedules placeholders instead, filled in the worker)
            running = [r for r in sched.running if not r.is_prefill_chunk]
            sched.update_draft_token_ids(DraftTokenIds(
                [r.request_id for r in running],
                [[(int(r.request_id[1:]) * 31 + r.num_tokens + j) % VOCAB for j in range(sched.num_spec_tokens)]
                 for r in running],
            ))  # fmt: skip
        for eco in outs.values():
            encoder.encode(eco)  # what the engine core sends to the frontend
        summary = summarize_outputs(outs)
        counts["finished"] += sum(1 for v in summary.values() if isinstance(v, tuple) and v[1] == "length")
        trace.append(("outputs", summary))

    step = -1
    while True:
        step += 1
        if step >= steps and not (drain and step < steps + 2000 and (pending or sched.has_requests())):
            break
        if on_step is not None:
            on_step(step)
        if "resets" in extras and step % 25 == 24:
            forced = step % 50 == 49
            trace.append(("reset", step, sched.reset_prefix_cache(reset_running_requests=forced)))
            counts["resets"] = counts.get("resets", 0) + 1
        for _ in range(rnd.choice((0, 0, 1, 1, 2)) if step < steps else 0):
            rid = f"r{nid}"
            nid += 1
            short = "junctions" in extras and extra_rnd.random() < 0.3
            prompt = rnd.choice(prefixes) + [
                rnd.randrange(VOCAB) for _ in range(1 if short else rnd.randint(1, 60))
            ]
            params = SamplingParams(max_tokens=rnd.randint(1, 40), ignore_eos=True)
            if "report" in extras and extra_rnd.random() < 0.4:
                params.extra_args = {"kv_cache_report_mode": "full"}
            priority = extra_rnd.randrange(3) if "priority" in extras else 0
            salt = extra_rnd.choice((None, None, None, "a", "b")) if "salt" in extras else None
            lora = None
            if "lora" in extras:
                n = extra_rnd.choice((0, 0, 0, 1, 2, 3))
                lora = LoRARequest(f"adapter-{n}", n, f"/adapters/{n}") if n else None
            embeds = None
            if "embeds" in extras and extra_rnd.random() < 0.25:
                tail = torch.randn(extra_rnd.randint(1, 40), 64, generator=embed_gen)
                embeds, prompt = torch.cat([extra_rnd.choice(embed_prefixes), tail]), None
            sched.add_request(Request(
                rid, prompt, params, None, **({} if V033 else {"eos_token_id": None}), block_hasher=hasher,
                priority=priority, cache_salt=salt, lora_request=lora, prompt_embeds=embeds,
            ))  # fmt: skip
        live = sorted(sched.requests)
        if aborts and live and rnd.random() < 0.06:
            victim = rnd.choice(live)
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            counts["aborted"] += 1
        out = sched.schedule()
        summary = summarize(out)
        counts["preempted"] += len(summary["preempted"])
        counts["scheduled"] += len(summary["num_scheduled_tokens"])
        counts["hit_tokens"] += sum(n for _, _, n, _ in summary["new"])
        counts["zeroed"] += len(summary["zero"] or ())
        trace.append(("schedule", step, summary))
        mro = fake_runner_output(sched, out, positional)
        if async_overlap:
            pending.append((out, mro))
            while len(pending) > queue_depth:
                apply(*pending.popleft())
        else:
            apply(out, mro)
    while pending:
        apply(*pending.popleft())
    for batch in recorder.batches:
        counts["events"] += len(batch.events)
        trace.append(("events", [repr(e) for e in batch.events]))
        encoder.encode(batch)
    return trace, counts


SCHEDULERS: dict[str, type[Scheduler]] = {"sync": Scheduler, "async": AsyncScheduler}


def manager_class_name(predict: bool) -> str:
    """The class of a kvcoord scheduler's session under this venv's vLLM: predicted or
    waiting for the pool, 0.33's kinds under vLLM 0.33."""
    return ("Predicting" if predict else "Remote") + ("033" if V033 else "") + "KVCacheManager"


def fingerprint_warnings(records: list[logging.LogRecord]) -> list[str]:
    """The plug-in's warnings that a pool is not, or no longer, predicted because the
    server's engine has other rules than this process's (its rules fingerprint)."""
    out = []
    for r in records:
        msg = r.getMessage()
        if (
            r.levelno >= logging.WARNING and r.name.startswith("kvcoord.client.vllm")
            and ("is not predicted" in msg or "can no longer be predicted" in msg) and "engine rules are" in msg
        ):  # fmt: skip
            out.append(msg)
    return out


def check_manager(manager: Any, predict: bool, records: list[logging.LogRecord]) -> None:
    """``manager`` (a scheduler's ``kv_cache_manager.remote``) is the session kind
    ``predict`` asks for. A predicted engine may run the waiting mode instead only when
    the plug-in warned that the server's engine has other rules (``records``: the
    test's log records): engine sources edited while the tests run give a server process
    started later another fingerprint than this process's, cached at its first use.
    Never silently."""
    name = type(manager).__name__
    if name == manager_class_name(predict):
        return
    assert predict and name == manager_class_name(False), (name, predict)
    assert fingerprint_warnings(records), (
        f"a predicted engine runs the waiting mode ({name}) without the warning that the server's engine has "
        "other rules"
    )


class FailingLoadsConnector(AsyncLoadsConnector):
    """Also failed loads: for one load in four, asynchronous or not, the worker reports
    the last block it loaded into invalid (``invalid_block_ids``) with the next output.
    vLLM's scheduler reads the tables of the requests it may concern, truncates their
    computed tokens and, with the ``fail`` policy, evicts the blocks and fails them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.invalid: set[int] = set()
        self.counts["failed loads"] = 0
        self._loads = 0
        self._local: dict[str, int] = {}  # locally cached tokens at the last query

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._local[request.request_id] = num_computed_tokens
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if not num_external_tokens:
            return
        self._loads += 1
        if self._loads % 4:
            return
        table = blocks.get_block_ids()[0]
        self.invalid.add(table[self._failed_index(self._local[request.request_id], num_external_tokens)])
        self.counts["failed loads"] += 1

    def _failed_index(self, local: int, num_external_tokens: int) -> int:
        """The failed block's index in the table: the last one loaded."""
        return -(-(local + num_external_tokens) // BLOCK_SIZE) - 1

    def worker_output(self) -> KVConnectorOutput | None:
        out = super().worker_output()
        if not self.invalid:
            return out
        out = out or KVConnectorOutput()
        out.invalid_block_ids = set(self.invalid)
        self.invalid.clear()
        return out


class FirstBlockFailingConnector(FailingLoadsConnector):
    """FailingLoadsConnector whose failed block is the first one a load wrote. With no
    local hit that is block 0 of the table: for an asynchronous load vLLM's scheduler
    then has no valid token, frees the request's blocks (the manager's ``free``) and
    keeps it waiting, and the same scan looks its prefix up and allocates again (the
    plug-in: the pool forgets the request, the lookup registers it again)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts["failed at block 0"] = 0
        self.counts["async, failed at block 0"] = 0
        self._no_hit = 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        # also every other load without a local hit, at block 0 (the retry succeeds)
        if num_external_tokens and self._local[request.request_id] < BLOCK_SIZE:
            self._no_hit += 1
            if self._no_hit % 2:
                self.invalid.add(blocks.get_block_ids()[0][0])
                self.counts["failed at block 0"] += 1
                self.counts["async, failed at block 0"] += request.request_id in self.loading

    def _failed_index(self, local: int, num_external_tokens: int) -> int:
        return local // BLOCK_SIZE


class FailedRecvingConnector(AsyncLoadsConnector):
    """Also failed asynchronous loads reported per request, as vLLM 0.33 requires with
    several KV cache groups (``invalid_block_ids`` raises there: block ids are per
    group): one asynchronous load in three is reported in ``failed_recving`` beside
    ``finished_recving``. vLLM 0.33's scheduler then sets the request's computed tokens
    to 0 (recompute policy) and frees its blocks before it is scheduled again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts["failed loads"] = 0
        self.failing: set[str] = set()

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        before = self.counts["async loads"]
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.counts["async loads"] > before and self.counts["async loads"] % 3 == 0:
            self.failing.add(request.request_id)
            self.counts["failed loads"] += 1

    def worker_output(self) -> KVConnectorOutput | None:
        failed = self.failing & self.receiving
        out = super().worker_output()
        if out is not None and failed:
            out.failed_recving = failed
            self.failing -= failed
        return out


class SlowTransfersConnector(AsyncLoadsConnector):
    """Asynchronous loads and sends that take ``LAG`` model outputs each (as a real
    transfer spans several steps), not one: a transfer's blocks are in use by the
    worker for ``LAG`` steps after the scheduler hands them over."""

    LAG = 6

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[tuple[int, set[str], set[str]]] = []  # (outputs left, recving, sending)

    def worker_output(self) -> KVConnectorOutput | None:
        if self.receiving or self.sending:
            self._pending.append((self.LAG, set(self.receiving), set(self.sending)))
            self.receiving.clear()
            self.sending.clear()
        recving: set[str] = set()
        sending: set[str] = set()
        left = []
        for n, r, s in self._pending:
            if n <= 1:
                recving |= r
                sending |= s
            else:
                left.append((n - 1, r, s))
        self._pending = left
        if not recving and not sending:
            return None
        self.loading -= recving
        return KVConnectorOutput(finished_recving=recving, finished_sending=sending)
