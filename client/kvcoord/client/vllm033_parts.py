"""What vLLM 0.33's scheduler and engine core reach beside the manager's methods, for
:mod:`kvcoord.client.vllm033`: ``kv_cache_manager.coordinator`` and
``kv_cache_manager.block_pool`` (each answers what kvcoord serves and refuses, by name,
what it does not), and the errors that name what the ``vllm-0.33`` plug-in refuses.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from kvcoord.wire import config_from_pb

from .vllm033_connector import DeferredFree

__all__ = [
    "BlockPool033",
    "Coordinator033",
    "RetainedBlock",
    "Unsupported033Error",
    "UnsupportedVLLMError",
    "copies_for_vllm",
]


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is a release kvcoord has no semantics profile for."""


class Unsupported033Error(NotImplementedError):
    """A vLLM 0.33 feature kvcoord's ``vllm-0.33`` pools do not reproduce (named)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RetainedBlock:
    """A block a copy-on-write pair keeps referenced (vLLM 0.33's ``retained_blocks`` of
    ``take_kv_cache_block_copies``): the scheduler hands it back to
    ``kv_cache_manager.block_pool.free_blocks`` once the copy's step ran. ``session`` is
    the session that took it: the retention ends with that session (the server
    releases what a session leaves), so a handle of an earlier one is not sent."""

    block_id: int
    session: str = ""


def copies_for_vllm(
    copies: list[tuple[int, int]], retained: list[int], session: str
) -> tuple[list[Any], list[Any]]:
    """The pool's copy-on-write pairs as vLLM 0.33's ``KVCacheBlockCopy``, and handles for
    the retained blocks that ``block_pool.free_blocks`` takes back (of ``session``, the
    session that took them)."""
    if not copies:
        return [], []
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    return [KVCacheBlockCopy(src_block_id=s, dst_block_id=d) for s, d in copies], [
        RetainedBlock(b, session) for b in retained
    ]


class Coordinator033:
    """What vLLM 0.33's scheduler and engine core read from ``kv_cache_manager.coordinator``:
    per group its block size and spec, whether fine-grained hits are on (the pool's
    layout: a mamba "align" block larger than the hash block), and
    ``get_num_blocks_to_allocate`` (a KV connector's asynchronous loads reserve blocks)."""

    def __init__(self, kv_cache_config: Any, remote: Any) -> None:
        self.remote = remote
        self.single_type_managers = tuple(
            types.SimpleNamespace(
                kv_cache_group_id=i, block_size=int(g.kv_cache_spec.block_size), kv_cache_spec=g.kv_cache_spec
            )
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        )
        #: fine-grained (partial) hits: the engine's rule (a hybrid pool with caching whose
        #: mamba "align" block is larger than the hash block)
        self.enable_partial_hash_hits = config_from_pb(remote.config).partial_hash_hits
        self.eagle_group_ids: tuple[int, ...] = ()
        self.num_reprefillable_tokens = 0

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any, num_encoder_tokens: int,
        total_computed_tokens: int, num_local_computed_tokens: int, num_tokens_main_model: int,
        apply_admission_cap: bool = False, prefill_end: int = 0,
    ) -> int:  # fmt: skip
        """The blocks the request would still take (vLLM 0.33's scheduler sums them into
        ``reserved_blocks`` for a KV connector's asynchronous loads), the pool's count.
        ``prefill_end`` matters to mamba groups only (a KV connector beside one is refused)."""
        if any(new_computed_blocks) or num_local_computed_tokens != total_computed_tokens:
            raise Unsupported033Error(
                "coordinator.get_num_blocks_to_allocate with a new hit or external tokens: kvcoord "
                "counts a request's remaining blocks only"
            )
        return int(
            self.remote.get_num_blocks_to_allocate(
                request_id, num_tokens, total_computed_tokens, num_tokens_main_model, apply_admission_cap,
                num_encoder_tokens,
            )
        )  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        raise Unsupported033Error(
            f"vLLM 0.33 read kv_cache_manager.coordinator.{name}: kvcoord's vllm-0.33 plug-in does not provide it"
        )


class BlockPool033:
    """vLLM 0.33 returns blocks to ``block_pool`` directly for deferred frees (a
    KV-consumer connector with overlapping steps: :class:`DeferredFree`) and for
    copy-on-write retentions once the copies ran (:class:`RetainedBlock`: released in
    the pool, in the order given; a handle of a session that ended is dropped, its
    retention ended with it, see ``session``)."""

    def __init__(self, free_deferred: Any, release_retained: Any, session: Any) -> None:
        self.free_deferred = free_deferred
        self.release_retained = release_retained
        #: the current session's id (a callable)
        self.session = session

    def free_blocks(self, ordered_blocks: Any) -> None:
        retained: list[int] = []
        current = self.session()
        for item in ordered_blocks:
            if isinstance(item, RetainedBlock):
                if item.session == current:
                    retained.append(item.block_id)
                continue
            if retained:
                self.release_retained(retained)
                retained = []
            if not isinstance(item, DeferredFree):
                raise Unsupported033Error(
                    "vLLM 0.33 freed blocks through kv_cache_manager.block_pool that are neither a "
                    "deferred free nor a copy's retained block: not supported by kvcoord's vllm-0.33 plug-in"
                )
            self.free_deferred(item.request_id)
        if retained:
            self.release_retained(retained)

    def __getattr__(self, name: str) -> Any:
        raise Unsupported033Error(
            f"vLLM 0.33 used kv_cache_manager.block_pool.{name}: kvcoord's vllm-0.33 plug-in provides "
            "only free_blocks (deferred frees, copy-on-write retentions)"
        )
