"""Routing helpers: hash a prompt for every pool, ask ScorePools, pick a pool.

A router that places requests on one of many vLLM engines (one kvcoord pool each)
asks the server which pool holds most of a prompt's KV cache. Pools may hash blocks
differently (function, block size, seed, and the vLLM release they follow: their
semantics profile and, for vllm-0.33, look-ahead tokens), so the prompt is hashed once
per distinct hash settings, with the request's LoRA name (and, for vllm-0.33 pools,
its path), cache salt and multimodal identifiers, exactly as a vLLM engine of that
pool would hash it (:func:`~kvcoord.client.hashing.block_hasher`).

The policy :func:`choose_pool` applies, and the order ScorePools answers in:

1. the longest prefix-cache hit (in tokens) wins;
2. on equal hits, the pool with the most free blocks;
3. then the pool name, so the choice is deterministic.

A pool that cannot take the prompt (ScorePoolsResponse.unscored: its max_model_len is
shorter, no prompt was hashed with its settings, or in a cluster its owner did not
answer in time) is never chosen.

Example::

    router = PoolRouter(client)
    best = router.pick(token_ids, lora_name="sql-adapter")
    if best is not None:
        send_to_engine_of(best.pool)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import score_rank

from .client import KVCoordClient
from .errors import NotFoundError
from .hashing import MultiModalItem, block_hasher, none_hash

__all__ = ["PoolRouter", "choose_pool", "hash_prompt", "score_rank"]

#: (hash_algo, hash_block_size, hash_seed, profile, num_hash_lookahead_tokens)
_Settings = tuple[str, int, str, str, int]


def _settings(config: pb.PoolConfig) -> _Settings:
    return (
        config.hash_algo,
        config.hash_block_size,
        config.hash_seed,
        config.profile or "vllm-0.16",
        config.num_hash_lookahead_tokens,
    )


def hash_prompt(
    pools: Iterable[pb.PoolInfo],
    token_ids: Sequence[int],
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MultiModalItem] = (),
) -> list[pb.HashedPrompt]:
    """The prompt's block hashes once per distinct hash settings of ``pools`` that
    cache prefixes (pools without caching need none): hash function, block size,
    seed, semantics profile and look-ahead tokens, each profile's hashing rules.

    Args:
        pools: the pools to score (``ListPools`` / ``GetPool`` answers).
        token_ids: the prompt.
        lora_name: the request's LoRA adapter name (vLLM adds it to every block's keys).
        lora_path: the adapter's path (vLLM 0.33 adds it too; needed with
            ``lora_name`` when a vllm-0.33 pool is scored).
        cache_salt: the request's cache salt (added to the first block's keys).
        mm_items: multimodal items (identifier and token span), as vLLM hashes them.

    Returns:
        One HashedPrompt per settings, in the order first met.

    Raises:
        ValueError: a LoRA name without its path when a vllm-0.33 pool is scored.
    """
    out: dict[_Settings, pb.HashedPrompt] = {}
    for info in pools:
        cfg = info.config
        if not cfg.enable_caching:
            continue
        key = _settings(cfg)
        if key in out:
            continue
        algo, size, seed, profile, lookahead = key
        hasher = block_hasher(
            profile, algo, size, none_hash(algo, seed, profile=profile), lora_name=lora_name,
            lora_path=lora_path, cache_salt=cache_salt, mm_items=mm_items, num_hash_lookahead_tokens=lookahead,
        )  # fmt: skip
        out[key] = pb.HashedPrompt(
            hash_algo=algo, hash_block_size=size, hash_seed=seed, block_hashes=hasher.extend(token_ids),
            profile="" if profile == "vllm-0.16" else profile, num_hash_lookahead_tokens=lookahead,
        )  # fmt: skip
    return list(out.values())


def choose_pool(response: pb.ScorePoolsResponse) -> pb.PoolScore | None:
    """The best scored pool by the module's policy, or ``None`` when none was scored."""
    if not response.scores:
        return None
    return min(response.scores, key=score_rank)


class PoolRouter:
    """Scores prompts against a server's pools with the sync client.

    The pools' hash settings come from ``ListPools`` (the pools the caller may see),
    read once and again whenever an answer shows them changed (a pool unknown, or one
    not scored for want of a prompt with its settings).

    A client of a cluster's replica set is answered by the first replica for every
    pool of the cluster (it asks the other owners for theirs; a pool whose owner does
    not answer in time is unscored, ``OWNER_UNREACHABLE``), and a reservation is made
    on the best pool's owner (docs/routing.md, "In a cluster").

    Args:
        client: the sync client to ask.
    """

    def __init__(self, client: KVCoordClient) -> None:
        self.client = client
        self._pools: dict[str, pb.PoolInfo] | None = None

    def pools(self, refresh: bool = False) -> dict[str, pb.PoolInfo]:
        """The pools the caller may see, by name (cached)."""
        if self._pools is None or refresh:
            self._pools = {p.name: p for p in self.client.list_pools().pools}
        return self._pools

    def score(
        self,
        token_ids: Sequence[int],
        candidate_pools: Sequence[str] = (),
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        include_block_ids: bool = False,
        reserve_seconds: float = 0.0,
    ) -> pb.ScorePoolsResponse:
        """ScorePools for this prompt (every visible pool without candidates), and
        with ``reserve_seconds`` a reservation of the best pool's hit.

        When the answer shows the pool list is stale (a pool not scored for want of
        its hash settings), the list is read again and the prompt scored again, unless
        a reservation was already made: that answer stands (its reservation is real)
        and the next call reads the list again.

        Raises:
            KVCoordError: as ``score_pools`` does (NotFoundError for a candidate that
                does not exist even after the pool list is read again).
        """
        if not token_ids:
            raise ValueError("the prompt has no tokens")
        for attempt in (0, 1):
            pools = self.pools(refresh=attempt == 1)
            wanted = [pools[n] for n in candidate_pools if n in pools] if candidate_pools else pools.values()
            prompts = hash_prompt(
                wanted,
                token_ids,
                lora_name=lora_name,
                lora_path=lora_path,
                cache_salt=cache_salt,
                mm_items=mm_items,
            )
            try:
                response = self.client.score_pools(
                    len(token_ids), prompts, candidate_pools, include_block_ids, reserve_seconds
                )
            except NotFoundError:
                if attempt:
                    raise
                continue
            stale = any(u.reason == "NO_PROMPT" for u in response.unscored)
            if stale and response.HasField("reservation"):
                self._pools = None
                return response
            if not stale or attempt:
                return response
        raise AssertionError("unreachable")

    def pick(
        self,
        token_ids: Sequence[int],
        candidate_pools: Sequence[str] = (),
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> pb.PoolScore | None:
        """The pool :func:`choose_pool` picks for this prompt (``None``: no pool can
        take it). To also hold its hit, call :meth:`score` with ``reserve_seconds``:
        the server reserves in the pool the policy picks, ``scores[0]``."""
        response = self.score(
            token_ids, candidate_pools, lora_name=lora_name, lora_path=lora_path, cache_salt=cache_salt,
            mm_items=mm_items,
        )  # fmt: skip
        return choose_pool(response)
