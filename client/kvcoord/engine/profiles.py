"""Semantics profiles: which vLLM release a pool answers like.

A pool is created with one profile and keeps it. ``vllm-0.16`` is kvcoord's original
behaviour (vLLM 0.16.0's v1 KV cache manager) and the default; ``vllm-0.33`` answers
like vLLM 0.33.0's. The differences are decided where each rule lives (the free
queue, the block pool, the hit search, statistics, events); this module only names
the profiles and holds the switches those places read, so that a 0.16 pool runs
exactly the code it always ran.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PROFILES", "VLLM_016", "VLLM_033", "ProfileRules", "rules_of"]

VLLM_016 = "vllm-0.16"
VLLM_033 = "vllm-0.33"
#: every profile a pool may be created with; the first is the default
PROFILES = (VLLM_016, VLLM_033)


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileRules:
    """The allocator-visible rules that differ between the profiles.

    Attributes:
        prepend_unhashed_frees: freed blocks without a hash (every freed block when
            caching is off) go to the head of the free queue, in the order given;
            hashed ones to the tail (vLLM 0.24+). Otherwise every freed block goes to
            the tail.
        stats_at_admission: prefix-cache statistics are recorded by
            ``record_prefix_cache_stats`` once a request is admitted (vLLM 0.27+), not
            by every lookup.
        common_prefix_zeros: ``get_num_common_prefix_blocks`` answers zeros (vLLM
            0.32+: cascade attention was removed).
        event_fields: KV events carry ``extra_keys``, ``group_idx`` and the spec kind
            (vLLM 0.17+ / 0.20+ / 0.22+).
        full_sequence_admission: ``allocate_slots`` takes ``full_sequence_must_fit``,
            ``reserved_blocks`` and the watermark inputs (vLLM 0.19+ / 0.23+ / 0.24+).
        two_phase_external: a first-use request's hit blocks are touched in every
            group before any group takes blocks for its external (KV connector)
            tokens (vLLM 0.24+); otherwise group by group, touch then external.
        hit_events: with KV events on, a lookup of a request in the "full" report
            mode (``Request.kv_cache_report_full``) that finds a hit re-announces the
            hit's blocks in a BlockStored per group (vLLM 0.26+).
    """

    prepend_unhashed_frees: bool
    stats_at_admission: bool
    common_prefix_zeros: bool
    event_fields: bool
    full_sequence_admission: bool
    two_phase_external: bool
    hit_events: bool


_RULES = {
    VLLM_016: ProfileRules(False, False, False, False, False, False, False),
    VLLM_033: ProfileRules(True, True, True, True, True, True, True),
}


def rules_of(profile: str) -> ProfileRules:
    """The rules of a profile name.

    Raises:
        KeyError: an unknown name (configs are validated before this is asked).
    """
    return _RULES[profile]
