"""A replica of one pool, in the client: every answer the server will give, at once.

vLLM's allocation is a function of the calls made, in order, and of the pool's state
when they start. An exclusive session is the only one to call, and the server hands it
the pool's state when it attaches (``PoolState``), so a client applying the same rules
to the same calls knows each answer before the server gives it.
:class:`PredictingKVCacheManager` answers from this replica and sends the calls after;
the server's answers must then equal the replica's, or every request is reported lost.

The replica covers the layout the server gives a state for: one full-attention group
whose block size is the hash block size. Its rules are vLLM's:

- the free queue: never-used blocks in id order first, then freed blocks in the order
  they were freed; new blocks come from the head, each losing the hash it was cached
  under (a BlockRemoved event);
- a freed request's blocks go to the tail last block first, as their counts reach 0;
- a prefix hit: the request's leading hashes found in the map, at most
  ``num_tokens - 1`` tokens; adopting it takes a reference on each block, pulling free
  ones out of the queue;
- an allocation needs ``ceil(slots / block_size)`` blocks in all, and the hit blocks it
  pulls out of the queue count against the free blocks too; one that does not fit
  changes nothing;
- each full block is cached once, under the request's hash for it (a block already
  under that hash keeps being the one found), one BlockStored event per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb

__all__ = ["PoolReplica", "ReplicaRefusal"]

_MEDIUM = "GPU"


class ReplicaRefusal(ValueError):
    """A call the server would refuse as invalid (nothing was changed)."""


class PoolReplica:
    """The pool's blocks as the server holds them, changed by the same calls.

    Args:
        config: the pool's configuration (one full-attention group).
        state: the pool's state when the session attached.
        lora_of: a request's LoRA adapter ``(id, name)`` or None, for its BlockStored
            events (called with what :meth:`allocate` was given as ``request``).
    """

    def __init__(
        self,
        config: pb.PoolConfig,
        state: pb.PoolState,
        lora_of: Callable[[Any], tuple[int, str] | None] = lambda request: None,
    ) -> None:
        self.lora_of = lora_of
        self.num_blocks = config.num_blocks
        self.block_size = int(config.groups[0].full.block_size)
        self.enable_caching = config.enable_caching
        self.enable_events = config.enable_kv_cache_events
        self.max_model_len = config.max_model_len or (1 << 62)
        self._next_fresh = state.next_fresh
        #: freed blocks, head first (the never-used ones come before them)
        self._used: OrderedDict[int, None] = OrderedDict.fromkeys(state.used_free_blocks)
        self._ref = [0] * self.num_blocks
        #: cached blocks: block -> hash, and hash -> the block a lookup finds; a hash
        #: cached in several blocks keeps them all, in order, in _more
        self._hash_of: dict[int, bytes] = {}
        self._first: dict[bytes, int] = {}
        self._more: dict[bytes, dict[int, None]] = {}
        for block_id, block_hash in zip(state.cached_block_ids, state.cached_block_hashes, strict=True):
            self._cache(block_hash, block_id)
        self.tables: dict[str, list[int]] = {}
        #: per request, its leading blocks already cached (adopted hits count)
        self._num_cached: dict[str, int] = {}
        #: events not taken yet, and statistics since they were last made
        self.events: list[pb.KVEvent] = []
        self.stats = pb.PrefixCacheStats()
        #: the same since the last :meth:`take_step` (what the server's answer to the
        #: Step carrying these calls must hold); the events are made in place in a
        #: StepResponse's ``events``, and ``events`` refers to them
        self.step_events = pb.StepResponse()
        self.step_stats = pb.PrefixCacheStats()

    # -- the pool's figures ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._used)

    @property
    def usage(self) -> float:
        """``1 - free / (num_blocks - 1)`` in vLLM's floating-point order."""
        total = self.num_blocks - 1
        return 0.0 if not total else 1.0 - (self.num_free_blocks / total)

    # -- calls ----------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes], num_tokens: int, preempted: bool) -> list[int]:
        """The hit's blocks for a request of ``num_tokens`` tokens (statistics recorded)."""
        first = self._first
        hit: list[int] = []
        for i in range(min((num_tokens - 1) // self.block_size, len(hashes))):
            block_id = first.get(hashes[i])
            if block_id is None:
                break
            hit.append(block_id)
        hit_tokens = len(hit) * self.block_size
        for stats in (self.stats, self.step_stats):
            if preempted:
                stats.preempted_requests += 1
                stats.preempted_queries += num_tokens
                stats.preempted_hits += hit_tokens
            else:
                stats.requests += 1
                stats.queries += num_tokens
                stats.hits += hit_tokens
        return hit

    def check(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_computed_tokens: int,
        num_new_tokens: int,
        hit: Sequence[int],
        hashes: Sequence[bytes],
    ) -> bool:
        """Whether a hit the allocation adopts is still cached under the request's
        hashes (``False``: stale, the server answers the allocation as refused and
        changes nothing); raises :class:`ReplicaRefusal` for an allocation the server
        would refuse as invalid. Changes nothing."""
        if num_new_tokens <= 0:
            raise ReplicaRefusal("num_new_tokens must be > 0")
        if num_computed_tokens + num_new_computed_tokens + num_new_tokens > self.max_model_len:
            raise ReplicaRefusal(f"computed plus new tokens exceed max_model_len {self.max_model_len}")
        if not hit:
            return True
        if self.tables.get(request_id) or request_id in self._num_cached:
            raise ReplicaRefusal(f"request {request_id!r} already holds blocks and cannot adopt a hit")
        if len(hit) > len(hashes) or num_new_computed_tokens != len(hit) * self.block_size:
            raise ReplicaRefusal(f"request {request_id!r}: the hit does not match its hashes or token count")
        hash_of = self._hash_of
        return all(hash_of.get(b) == h for b, h in zip(hit, hashes, strict=False))

    def allocate(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_computed_tokens: int,
        num_new_tokens: int,
        hit: Sequence[int],
        num_lookahead_tokens: int,
        tokens: Sequence[int],
        hashes: Sequence[bytes],
        request: Any = None,
    ) -> list[int] | None:
        """vLLM's ``allocate_slots`` (call :meth:`check` first): the new blocks, or
        ``None`` (nothing changed) when too few are free. ``request`` is handed to
        ``lora_of`` when an event is made."""
        bs = self.block_size
        total = num_computed_tokens + num_new_computed_tokens
        need = total + num_new_tokens + num_lookahead_tokens
        if need > self.max_model_len:
            need = self.max_model_len
        tables = self.tables
        table = tables.get(request_id)
        if hit:
            if not self._adopt(request_id, hit, -(-need // bs)):
                return None
            table = tables[request_id]
            new = self._take(-(-need // bs) - len(table))
            table.extend(new)
        else:
            missing = -(-need // bs) - (len(table) if table is not None else 0)
            if missing > 0:
                if missing > self.num_blocks - self._next_fresh + len(self._used):
                    return None
                new = self._take(missing)
            else:
                new = []
            if table is None:
                table = tables[request_id] = new[:]
            else:
                table.extend(new)
        if self.enable_caching:
            end = min(total + num_new_tokens, len(tokens)) // bs
            if end > self._num_cached.get(request_id, 0):
                self._cache_full(request_id, table, end, tokens, hashes, request)
        return new

    def grow(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        tokens: Sequence[int],
        hashes: Sequence[bytes],
        request: Any = None,
    ) -> list[int] | None:
        """:meth:`allocate` without a hit (decode above all), in fewer steps."""
        bs = self.block_size
        need = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if need > self.max_model_len:
            need = self.max_model_len
        table = self.tables.get(request_id)
        missing = -(-need // bs) - (len(table) if table is not None else 0)
        if missing > 0:
            if missing > self.num_blocks - self._next_fresh + len(self._used):
                return None
            new = self._take(missing)
            if table is None:
                table = self.tables[request_id] = new[:]
            else:
                table.extend(new)
        else:
            new = []
            if table is None:
                table = self.tables[request_id] = []
        if self.enable_caching:
            end = num_computed_tokens + num_new_tokens
            if end > len(tokens):
                end = len(tokens)
            end //= bs
            if end > self._num_cached.get(request_id, 0):
                self._cache_full(request_id, table, end, tokens, hashes, request)
        return new

    def _adopt(self, request_id: str, hit: Sequence[int], required: int) -> bool:
        """A first allocation's hit: refused (False, nothing changed) unless the new
        blocks and the hit blocks leaving the free queue fit; else adopted."""
        ref = self._ref
        take = max(required - len(hit), 0) + sum(1 for b in hit if not ref[b])
        if take > self.num_free_blocks:
            return False
        used = self._used
        for block_id in hit:
            if not ref[block_id]:
                del used[block_id]
            ref[block_id] += 1
        self.tables[request_id] = list(hit)
        self._num_cached[request_id] = len(hit)
        return True

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last first."""
        table = self.tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if not table:
            return
        ref, used = self._ref, self._used
        for block_id in reversed(table):
            left = ref[block_id] - 1
            ref[block_id] = left
            if not left:
                used[block_id] = None

    def caches(self, request_id: str, num_tokens: int) -> bool:
        """Whether :meth:`cache` would cache a block (a block became full)."""
        return num_tokens // self.block_size > self._num_cached.get(request_id, 0)

    def cache(
        self,
        request_id: str,
        num_tokens: int,
        tokens: Sequence[int],
        hashes: Sequence[bytes],
        request: Any = None,
    ) -> None:
        """vLLM's ``cache_blocks``: the request's blocks full within ``num_tokens``
        become hits (see :meth:`allocate`'s ``request``)."""
        end = num_tokens // self.block_size
        if end > self._num_cached.get(request_id, 0):
            self._cache_full(request_id, self.tables.setdefault(request_id, []), end, tokens, hashes, request)

    def evict(self, block_ids: Sequence[int]) -> None:
        """Forget the cached hash of each block, in the order given (KV connector load
        failures); counts and the free queue stay."""
        hash_of = self._hash_of
        for block_id in block_ids:
            block_hash = hash_of.pop(block_id, None)
            if block_hash is not None:
                self._uncache(block_hash, block_id)

    def reset(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds a block."""
        if self.num_blocks - self.num_free_blocks != 1:
            return False
        self._hash_of.clear()
        self._first.clear()
        self._more.clear()
        if self.enable_events:
            event = self.step_events.events.add()
            event.all_blocks_cleared.SetInParent()
            self.events.append(event)
        self.stats.reset = self.step_stats.reset = True
        return True

    def common_prefix(self, request_id: str) -> int:
        """The request's leading blocks held by every request holding a table (vLLM
        registers an empty table for a request without one, which then counts too); 0
        without prefix caching, as vLLM's coordinator for that case answers."""
        if not self.enable_caching:
            return 0
        table = self.tables.setdefault(request_id, [])
        holders, ref = len(self.tables), self._ref
        n = 0
        for block_id in table:
            if ref[block_id] != holders:
                break
            n += 1
        return n

    def take_stats(self) -> pb.PrefixCacheStats:
        stats, self.stats = self.stats, pb.PrefixCacheStats()
        return stats

    def take_step(self) -> tuple[pb.StepResponse, pb.PrefixCacheStats]:
        """Events (in a StepResponse's ``events``) and statistics since the previous call."""
        events, stats = self.step_events, self.step_stats
        self.step_events, self.step_stats = pb.StepResponse(), pb.PrefixCacheStats()
        return events, stats

    # -- the rules ------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n <= 0:
            return []
        fresh = self._next_fresh
        from_fresh = min(n, self.num_blocks - fresh)
        out = list(range(fresh, fresh + from_fresh))
        self._next_fresh = fresh + from_fresh
        ref, hash_of = self._ref, self._hash_of
        popitem = self._used.popitem
        for _ in range(n - from_fresh):
            block_id = popitem(last=False)[0]
            block_hash = hash_of.pop(block_id, None)
            if block_hash is not None:
                self._uncache(block_hash, block_id)
            out.append(block_id)
        for block_id in out:
            ref[block_id] = 1
        return out

    def _cache(self, block_hash: bytes, block_id: int) -> None:
        self._hash_of[block_id] = block_hash
        first = self._first.setdefault(block_hash, block_id)
        if first != block_id:
            more = self._more.get(block_hash)
            if more is None:
                self._more[block_hash] = {first: None, block_id: None}
            else:
                more[block_id] = None

    def _uncache(self, block_hash: bytes, block_id: int) -> None:
        more = self._more.get(block_hash)
        if more is None:
            del self._first[block_hash]
        else:
            del more[block_id]
            self._first[block_hash] = next(iter(more))
            if len(more) == 1:
                del self._more[block_hash]
        if self.enable_events:
            event = self.step_events.events.add()
            removed = event.block_removed
            removed.block_hashes.append(block_hash)
            removed.medium = _MEDIUM
            self.events.append(event)

    def _cache_full(
        self,
        request_id: str,
        table: list[int],
        end: int,
        tokens: Sequence[int],
        hashes: Sequence[bytes],
        request: Any,
    ) -> None:
        bs = self.block_size
        start = self._num_cached.get(request_id, 0)
        stored = [bytes(h) for h in hashes[start:end]]
        for block_id, block_hash in zip(table[start:end], stored, strict=True):
            self._cache(block_hash, block_id)
        self._num_cached[request_id] = end
        if self.enable_events:
            event = self.step_events.events.add()
            st = event.block_stored
            st.block_hashes.extend(stored)
            if start:
                st.parent_block_hash = bytes(hashes[start - 1])
            st.token_ids.extend(tokens[start * bs : end * bs])
            st.block_size = bs
            st.medium = _MEDIUM
            adapter = self.lora_of(request)
            if adapter is not None:
                st.lora_id, st.lora_name = adapter
            self.events.append(event)
