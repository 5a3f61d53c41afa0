"""Configs and plants for the KV oracle on chunked-local and mamba layouts
(test_kv_oracle_layouts.py, test_layouts_under_faults.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import V033, kv_cache_config, vllm_config


def layout_configs(
    layout: str, model_dir: Path, blocks: int, *, asynchronous: bool, speculative: str | None = None,
    connector: str | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """(VllmConfig, KVCacheConfig) for ``layout``: a mamba group outside "align" mode with
    caching off (vLLM 0.33 requires it); a mamba group gets one speculative block per
    draft. "partial": full attention and mamba "align" of 32-token blocks hashed every 16
    tokens (fine-grained hits with copy-on-write, vLLM 0.33)."""
    if layout == "partial":  # (vLLM 0.33: fine-grained hits, copy-on-write, 32-token blocks)
        from test_scheduler_equivalence import _partial_hits_kv_config

        cfg = vllm_config(model_dir, blocks, async_scheduling=asynchronous, mamba_cache_mode="align",
                          speculative=speculative, connector=connector)  # fmt: skip
        cfg.cache_config.block_size = 32
        cfg.cache_config.prefix_match_unit = 16
        return cfg, _partial_hits_kv_config(blocks)
    mamba = "mamba" in layout
    align = mamba and layout.endswith("align")
    spec_blocks = 0 if speculative is None or not mamba else 3 if speculative == "ngram" else 2
    cfg = vllm_config(
        model_dir, blocks, async_scheduling=asynchronous, enable_caching=not mamba or align,
        mamba_cache_mode="align" if align else "none", speculative=speculative, connector=connector,
    )  # fmt: skip
    return cfg, kv_cache_config(layout, blocks, spec_blocks)


def group_of(sched: Any, kind: str) -> int:
    """The index of the first KV cache group of spec class ``kind``."""
    for g, group in enumerate(sched.kv_cache_config.kv_cache_groups):
        if type(group.kv_cache_spec).__name__ == kind:
            return g
    raise LookupError(kind)


def plant_group_swap(s: Any, group: int | None, min_computed: int = 48) -> dict[str, Any]:
    """Once: two running requests of different prefixes get each other's blocks in
    ``group`` only (as resumed with their own tables otherwise): a defect no other group
    shows. ``group`` ``None``: in every group (each gets the other's whole table)."""
    schedule = s.schedule
    done: dict[str, Any] = {}

    def swapping() -> Any:
        out = schedule()
        c = out.scheduled_cached_reqs
        if done or len(c.req_ids) < 2:
            return out
        cand = [
            i for i, (rid, n) in enumerate(zip(c.req_ids, c.num_computed_tokens, strict=True))
            if n >= min_computed and rid not in c.resumed_req_ids
        ]  # fmt: skip
        for i in cand:
            for j in cand:
                a, b = c.req_ids[i], c.req_ids[j]
                ta, tb = s.kv_cache_manager.get_block_ids(a), s.kv_cache_manager.get_block_ids(b)
                ra, rb = s.requests[a], s.requests[b]
                if i < j and list(ra.all_token_ids[:min_computed]) != list(rb.all_token_ids[:min_computed]):
                    new_a = tuple(list(x) for x in ta)
                    new_b = tuple(list(x) for x in tb)
                    swapped = range(len(ta)) if group is None else (group,)
                    for g in swapped:
                        new_a[g][:], new_b[g][:] = list(tb[g]), list(ta[g])
                    if all(new_a[g] == new_b[g] for g in swapped):
                        continue
                    c.resumed_req_ids = set(c.resumed_req_ids) | {a, b}
                    c.new_block_ids[i], c.new_block_ids[j] = new_a, new_b
                    done["pair"] = (a, b)
                    return out
        return out

    s.schedule = swapping
    return done


__all__ = ["V033", "group_of", "layout_configs", "plant_group_swap"]
