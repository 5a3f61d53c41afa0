"""What the engine knows of one request: the fields vLLM's managers read."""

from __future__ import annotations

import dataclasses

from .extra_keys import EMPTY_EMBEDS_DIGEST, ExtraKeySources, block_extra_keys_033, event_extra_keys
from .types import RequestId

__all__ = ["LoRA", "Request"]


@dataclasses.dataclass(frozen=True, slots=True)
class LoRA:
    """A LoRA adapter: its integer id and name go into KV events."""

    adapter_id: int
    name: str


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """A request's token ids, fine-grained block hashes and scheduling progress.

    ``block_hashes`` holds one hash per full ``hash_block_size`` block of
    ``all_token_ids`` (empty when caching is off). ``num_computed_tokens`` is kept
    by the scheduler (the client) and reported to the pool before each call.
    """

    request_id: RequestId
    all_token_ids: list[int]
    block_hashes: list[bytes]
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    lora: LoRA | None = None
    skip_reading_prefix_cache: bool = False
    #: block ids of the request's last lookup and the pool's hash epoch at that time
    last_hit: tuple[tuple[tuple[int, ...], ...], int] | None = None
    #: the cache namespace's key prefix (b"": vLLM's keys; see KVCachePool.add_request)
    cache_prefix: bytes = b""
    #: the request's cache salt (vllm-0.33 pools report it in events' extra keys)
    cache_salt: str | None = None
    #: the prompt's length (vllm-0.33: sparse retention keeps the prompt's replay boundary)
    num_prompt_tokens: int = 0
    #: vllm-0.33: where the last lookup found a shared prefix that a sparse group has
    #: not cached (0: none); the request's later caching keeps that junction hittable
    shared_prefix_boundary: int = 0
    #: vllm-0.33: the multimodal items and prompt-embeds digests its blocks' extra keys
    #: derive from (reported in events; ``None``: neither)
    extra_key_sources: ExtraKeySources | None = None
    #: vLLM 0.33's ``kv_cache_report_mode == "full"``: a vllm-0.33 pool with events
    #: re-announces the blocks of each hit the request looks up (PrefixHits)
    kv_cache_report_full: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def event_extra_keys(
        self, block_index: int, block_size: int, lookahead: int
    ) -> tuple[object, ...] | None:
        """vLLM 0.33's untagged extra keys of block ``block_index`` (of ``block_size``
        tokens, its span reaching ``lookahead`` tokens further) for KV events:
        :func:`~kvcoord.engine.extra_keys.block_extra_keys_033`'s, untagged; ``None``
        when empty. (Prompt-embeds digests are per hash block: the pool admits them
        only where every group's block is one hash block.)"""
        start = block_index * block_size
        lora = ("lora", self.lora.name, "") if self.lora is not None else None  # (events name it only)
        sources = self.extra_key_sources
        if sources is None:
            keys = block_extra_keys_033(start, start + block_size, lora=lora, cache_salt=self.cache_salt)
        else:
            digests = sources.embeds_digests
            digest = None
            if digests is not None:
                digest = digests[block_index] if block_index < len(digests) else EMPTY_EMBEDS_DIGEST
            keys = block_extra_keys_033(
                start, start + block_size + lookahead, lora=lora, mm_items=sources.mm_items,
                cache_salt=self.cache_salt, embeds_digest=digest,
            )  # fmt: skip
        return event_extra_keys(keys)
