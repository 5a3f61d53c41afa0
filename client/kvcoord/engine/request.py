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

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
