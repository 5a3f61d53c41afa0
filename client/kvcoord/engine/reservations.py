"""Reservations: a prefix hit held against eviction until a request adopts it.

A router scores a prompt (the read-only ``find_longest_cache_hit``), sends the request
to the best pool, and the request arrives there some milliseconds later; meanwhile
other requests may evict the blocks it was promised. A reservation takes one reference
on each block of the hit, as a request holding them would, so no allocation can reuse
them. It ends either when a request of the prompt that was scored (same cache
namespace, same block hashes, same number of tokens: the request the hit was promised
to) makes its first allocation (the request has taken its own references by then, so
blocks it shares never move in the free queue), or when it is released (time to live,
decided by the service).

Only that prompt adopts it: a request sharing just the hit's blocks may be promised
less (a hit covers at most ``num_tokens - 1`` tokens, and with EAGLE it depends on the
block after it), and taking the reservation from the request it was made for would
let that request's hit be evicted before its time runs out.

vLLM has no reservations: a pool with none behaves exactly like vLLM's manager, and
one with reservations like a pool where an extra request holds those blocks. Releasing
a block puts it back as a request's free would: each group in order, its blocks tail
first, so among the released blocks the last of a chain is evicted first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .block_pool import BlockPool
from .hash_list import hashes_at_block_size
from .profiles import VLLM_016
from .results import CacheHit

if TYPE_CHECKING:
    from .config import KVCacheConfig
    from .hits import PrefixHits

__all__ = ["Reservation", "ReservationCounters", "Reservations", "read_by_eagle_search"]


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """One held hit: the hit, the blocks held per group (the hit's, without null
    blocks; with EAGLE also every block cached under the prompt's hashes that the
    search reads, since the hit depends on the block it drops), the cache namespace's
    key prefix, and the scored prompt: the raw hash of its last full
    ``hash_block_size`` block (with the chained hashes, it names every block), its
    number of hashes and its number of tokens (the search's input, so a request of
    that prompt is promised exactly ``hit``)."""

    reservation_id: str
    hit: CacheHit
    held: tuple[tuple[int, ...], ...]
    namespace_prefix: bytes
    last_hash: bytes
    num_hashes: int
    num_tokens: int


@dataclasses.dataclass(slots=True)
class ReservationCounters:
    """Lifetime counts (never reset): made, adopted by a request, released otherwise,
    and the hit tokens adopted reservations promised against those their requests got."""

    made: int = 0
    adopted: int = 0
    released: int = 0
    promised_tokens: int = 0
    got_tokens: int = 0
    #: adopted reservations whose request got a shorter hit than promised
    short_hits: int = 0


class Reservations:
    """The pool's live reservations, oldest first.

    Args:
        block_pool: the pool's blocks (references are taken and dropped here).
        hash_block_size: tokens per request block hash.
    """

    def __init__(self, block_pool: BlockPool, hash_block_size: int) -> None:
        self.block_pool = block_pool
        self.hash_block_size = hash_block_size
        #: reservation id -> reservation, in the order they were made
        self.live: dict[str, Reservation] = {}
        self.counters = ReservationCounters()

    def hold(
        self,
        reservation_id: str,
        hit: CacheHit,
        held: Sequence[Sequence[int]],
        namespace_prefix: bytes,
        hashes: Sequence[bytes],
        num_tokens: int,
    ) -> None:
        """Take a reference on every block of ``held`` (per group, in position order:
        the blocks ``hit``, found just now for the prompt of these hashes and
        ``num_tokens`` tokens, depends on) and remember them under ``reservation_id``
        (new). ``hit`` is not empty (so neither is ``hashes``)."""
        assert reservation_id not in self.live and hit.num_tokens > 0 and hashes
        bp = self.block_pool
        blocks = bp.blocks
        kept = tuple(tuple(b for b in ids if b) for ids in held)
        for ids in kept:
            bp.touch(blocks[b] for b in ids)
        self.live[reservation_id] = Reservation(
            reservation_id, hit, kept, namespace_prefix, hashes[-1], len(hashes), num_tokens
        )
        self.counters.made += 1

    def release(self, reservation_id: str) -> Reservation | None:
        """Drop the reservation's references (blocks left unheld go to the free queue's
        tail, each group's tail first); ``None`` when it is not live."""
        r = self.live.pop(reservation_id, None)
        if r is None:
            return None
        bp = self.block_pool
        blocks = bp.blocks
        for ids in r.held:
            bp.free_blocks(blocks[b] for b in reversed(ids))
        return r

    def expire(self, reservation_id: str) -> bool:
        """Release a reservation no request adopted (its time ran out)."""
        if self.release(reservation_id) is None:
            return False
        self.counters.released += 1
        return True

    def adopt(
        self, namespace_prefix: bytes, block_hashes: Sequence[bytes], num_tokens: int, got_tokens: int
    ) -> Reservation | None:
        """A request with these hashes and ``num_tokens`` tokens made its first
        allocation, with a hit of ``got_tokens``: release the oldest reservation made
        for its prompt, if any, and count what it promised against what the request
        got."""
        for r in self.live.values():
            if (
                r.num_tokens == num_tokens
                and r.num_hashes == len(block_hashes)
                and r.namespace_prefix == namespace_prefix
                and block_hashes[-1] == r.last_hash
            ):
                self.release(r.reservation_id)
                c = self.counters
                c.adopted += 1
                c.promised_tokens += r.hit.num_tokens
                c.got_tokens += got_tokens
                if got_tokens < r.hit.num_tokens:
                    c.short_hits += 1
                return r
        return None

    def held_blocks(self) -> dict[int, int]:
        """Block id -> references the reservations hold on it (invariant checks)."""
        out: dict[int, int] = {}
        for r in self.live.values():
            for ids in r.held:
                for b in ids:
                    out[b] = out.get(b, 0) + 1
        return out


def read_by_eagle_search(
    hits: PrefixHits, config: KVCacheConfig, keys: Sequence[bytes], num_tokens: int
) -> list[list[int]]:
    """Per group, in position order, the blocks cached under a prompt's keys that its
    search with EAGLE's drop may read (the hit depends on each: every pass drops the
    block it matched last). When the search starts with full attention, that group's
    run of cached keys ends at its first miss, where its search stops, and caps every
    other group's search (a vllm-0.33 hybrid's group peeks one of its blocks past
    it): no block beyond is read, so none is held (was: every block cached under the
    keys up to the search's reach, past any gap)."""
    reach = hits.eagle_reach(keys, num_tokens)
    first = hits.first_full
    if first is None:
        return hits.cached_under(keys, reach)
    maps = hits.block_pool.cached_block_hash_to_block.first
    hbs = config.hash_block_size
    gid, size = first
    cached = maps[gid]
    run = 0
    for key in hashes_at_block_size(keys, hbs, size)[: reach // size]:
        if key not in cached:
            break
        run += 1
    peeks = config.coordinator_kind == "hybrid" and config.profile != VLLM_016
    out = []
    for g, spec in enumerate(config.groups):
        b_size = spec.block_size
        limit = min(reach, run * size + (b_size if peeks and g != gid else 0)) // b_size
        get = maps[g].get
        out.append([b for h in hashes_at_block_size(keys, hbs, b_size)[:limit] if (b := get(h))])
    return out
