"""What the engine knows of one request: the fields vLLM's managers read."""

from __future__ import annotations

import dataclasses

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

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def event_extra_keys(self, block_index: int) -> tuple[object, ...] | None:
        """vLLM 0.33's untagged extra keys of one block for KV events: the LoRA name
        (every block), then the cache salt (first block only); ``None`` when empty."""
        keys: list[object] = []
        if self.lora is not None:
            keys.append(self.lora.name)
        if block_index == 0 and self.cache_salt:
            keys.append(self.cache_salt)
        return tuple(keys) if keys else None
