"""Reservations: a prefix hit held against eviction until a request adopts it.

A router scores a prompt (the read-only ``find_longest_cache_hit``), sends the request
to the best pool, and the request arrives there some milliseconds later; meanwhile
other requests may evict the blocks it was promised. A reservation takes one reference
on each block of the hit, as a request holding them would, so no allocation can reuse
them. It ends either when a request with the same prefix (same cache namespace, the
same hash at the hit's last block) makes its first allocation (the request has taken
its own references by then, so blocks it shares never move in the free queue), or
when it is released (time to live, decided by the service).

vLLM has no reservations: a pool with none behaves exactly like vLLM's manager, and
one with reservations like a pool where an extra request holds those blocks. Releasing
a block puts it back as a request's free would: each group in order, its blocks tail
first, so among the released blocks the last of a chain is evicted first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .block_pool import BlockPool
from .results import CacheHit

__all__ = ["Reservation", "ReservationCounters", "Reservations"]


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """One held hit: the hit, the blocks held per group (the hit's, without null
    blocks; with EAGLE also every block cached under the prompt's hashes that the
    search reads, since the hit depends on the block it drops), the cache namespace's
    key prefix, and the raw hash of the hit's last ``hash_block_size`` block (with
    the chained hashes, it names the whole prefix)."""

    reservation_id: str
    hit: CacheHit
    held: tuple[tuple[int, ...], ...]
    namespace_prefix: bytes
    last_hash: bytes
    num_hashes: int


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
    ) -> None:
        """Take a reference on every block of ``held`` (per group, in position order:
        the blocks ``hit``, found just now for these request hashes, depends on) and
        remember them under ``reservation_id`` (new). ``hit`` is not empty."""
        assert reservation_id not in self.live and hit.num_tokens > 0
        n = hit.num_tokens // self.hash_block_size
        bp = self.block_pool
        blocks = bp.blocks
        kept = tuple(tuple(b for b in ids if b) for ids in held)
        for ids in kept:
            bp.touch(blocks[b] for b in ids)
        self.live[reservation_id] = Reservation(reservation_id, hit, kept, namespace_prefix, hashes[n - 1], n)
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
        self, namespace_prefix: bytes, block_hashes: Sequence[bytes], got_tokens: int
    ) -> Reservation | None:
        """A request with these hashes made its first allocation, with a hit of
        ``got_tokens``: release the oldest reservation of its prefix, if any, and count
        what it promised against what the request got."""
        for r in self.live.values():
            n = r.num_hashes
            if (
                r.namespace_prefix == namespace_prefix
                and len(block_hashes) >= n
                and block_hashes[n - 1] == r.last_hash
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
