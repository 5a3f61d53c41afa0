"""A decode step's allocations in one engine call: the entries of a DecodeOp (columns).

:func:`decode_run` applies entries one after another exactly as
:meth:`~kvcoord.engine.pool.KVCachePool.update_and_allocate` would, for as long as each
is a decode step it can answer without any check that could fail after the pool has
changed: one valid token appended (with the hash of the block it completes, if it
completes one), valid counts, the request's blocks held in every group, no block
leaving a window, and enough free blocks. It stops at the first entry that is anything
else (and leaves that entry untouched), so that its caller applies it by the general
path, which answers, refuses or raises exactly as it would have, and then calls again.

Two kinds of entry are taken:

* inside its blocks (most decode steps): the update alone (as
  ``KVCachePool._decode_inside_blocks``);
* one that takes a new block or caches a full one (one decode step in a block's
  worth): the update, the blocks taken and the full blocks cached as
  ``KVCachePool._allocate_without_hit`` does, the same calls to the block pool (its
  events and counters too).

Only for pools whose every group allocates, caches and skips by the base rules (the
pool's ``decode_fast_path``); any other pool takes no entry here. A run whose entries
are all each request's next token (computed count at the position, one new token, no
look-ahead), in a caching pool of one group without skip rule or hash lag, takes a
shorter loop (:func:`_run_next_token`), the same checks with fewer values to read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Protocol, TypeVar

from ._mypyc import mypyc_attr
from .decode_columns import DecodeColumns
from .events import block_stored
from .request_table import TokenIds

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .config import KVCacheConfig
    from .managers import SingleTypeKVCacheManager
    from .request import Request

__all__ = ["Counts", "DecodeColumns", "decode_run"]

T = TypeVar("T")


@mypyc_attr(native_class=False)  # a list: mypyc compiles no subclass of one
class Counts(list[int]):
    """A column of counts its maker guarantees are non-negative ``int``s (not ``bool``),
    such as one read from a ``uint32`` wire column: :func:`decode_run` checks only the
    bounds such a column's values could break (as :class:`TokenIds` for tokens)."""

    __slots__ = ()


class KVCachePool(Protocol):
    """What this module reads of :class:`~kvcoord.engine.pool.KVCachePool` (whose part
    it is; named so that this module need not import the pool's)."""

    config: KVCacheConfig
    requests: dict[str, Request]
    managers: list[SingleTypeKVCacheManager]
    block_pool: BlockPool
    max_model_len: int
    enable_caching: bool
    hash_block_size: int
    decode_fast_path: bool
    hash_lag: int
    skipping_managers: list[SingleTypeKVCacheManager]

    def num_to_take(self, rid: str, need: int, total: int, main: int) -> int: ...

    def cache_full_request_blocks(self, req: Request, cached: int) -> None: ...


def decode_run(
    pool: KVCachePool,
    cols: DecodeColumns,
    start: int,
    stop: int,
    t: int,
    h: int,
    counts: list[int],
    ids: list[int],
) -> tuple[int, int, int]:
    """Apply entries ``start .. stop-1`` of ``cols`` (the appended tokens and hashes
    read from positions ``t`` and ``h``) while each is one this module takes; see the
    module's docstring. Entry ``i``'s new block count of group ``g`` is written to
    ``counts[i * groups + g]`` (left as it is, 0, when it takes none) and its new block
    ids appended to ``ids``, group after group.

    The caller checks that the columns have one value per entry and that the appended
    values add up, and that the entries' requests are its own.

    Returns:
        ``(i, t, h)``: the first entry not applied (``stop`` when every one was) and
        where its appended tokens and hashes start. Entry ``i`` is left untouched.
    """
    if not pool.decode_fast_path:
        return start, t, h
    while start < stop:
        end = _plain_end(cols, start, stop, t)
        if end == start:
            break  # entry ``start`` is not one this module takes: the general path's
        i, t, h = _run_plain(pool, cols, start, end, t, h, counts, ids)
        if i < end:
            return i, t, h
        start = end
    return start, t, h


def plain_values(num_tokens: object, token: object, computed: object, num_new: object, look: object) -> bool:
    """Whether one decode step's values are those the fast paths take: one token, a
    non-negative int (not bool); computed and look-ahead counts non-negative ints, the
    new-token count a positive int. (Counts past max_model_len are the caller's.)"""
    return (
        num_tokens == 1
        and type(token) is int
        and token >= 0
        and type(computed) is int
        and computed >= 0
        and type(num_new) is int
        and num_new > 0
        and type(look) is int
        and look >= 0
    )


def _plain_end(cols: DecodeColumns, start: int, stop: int, t: int) -> int:
    """The first entry from ``start`` (``stop`` if none) whose values :func:`_run_plain`
    does not read as a plain decode step's (:func:`plain_values`, at most one hash).
    Entry ``start`` is read first; then the whole range column by column in C (a decode
    step's usual case), and only when that fails the entries one by one."""
    num_t, num_h = cols.num_append_tokens, cols.num_append_hashes
    tokens = cols.append_token_ids
    computed, new, look = cols.num_computed_tokens, cols.num_new_tokens, cols.num_lookahead_tokens

    def plain(i: int) -> bool:  # (the entries before i append one token each)
        nh = num_h[i]
        token = tokens[t + i - start] if num_t[i] == 1 else None
        return (
            type(nh) is int and 0 <= nh <= 1 and plain_values(num_t[i], token, computed[i], new[i], look[i])
        )

    if not plain(start):
        return start
    n = stop - start
    if (
        _part(num_t, start, stop).count(1) == n
        and _at_least(tokens, t, t + n, 0)
        and _at_least(num_h, start, stop, 0)
        and max(_part(num_h, start, stop)) <= 1
        and _at_least(computed, start, stop, 0)
        and _at_least(look, start, stop, 0)
        and _at_least(new, start, stop, 1)
    ):
        return stop
    i = start + 1
    while i < stop and plain(i):
        i += 1
    return i


def _part(column: Sequence[T], start: int, stop: int | None) -> Sequence[T]:
    """``column[start:stop]`` for reading only: the column itself when that is all of it
    (a decode Step's usual single run: no copy of each column, two or three times over),
    else a copy of the part."""
    return column if start == 0 and (stop is None or stop == len(column)) else column[start:stop]


def _at_least(column: Sequence[int], start: int = 0, stop: int | None = None, least: int = 0) -> bool:
    """Whether ``column[start:stop]`` (not empty) holds ints (not bools) of at least
    ``least``: a pass or two in C; a :class:`Counts` or :class:`TokenIds` column's
    are ints, and >= 0."""
    part = _part(column, start, stop)
    if type(column) is Counts or type(column) is TokenIds:
        return least <= 0 or min(part) >= least
    return set(map(type, part)) == {int} and min(part) >= least


def _run_plain(
    pool: KVCachePool,
    cols: DecodeColumns,
    start: int,
    stop: int,
    t: int,
    h: int,
    counts: list[int],
    ids: list[int],
) -> tuple[int, int, int]:
    """:func:`decode_run` over entries whose values :func:`_plain_end` checked (by
    :func:`_run_next_token` when they are all a plain next token's)."""
    if _next_token_columns(pool, cols, start, stop):
        return _run_next_token(pool, cols, start, stop, t, h, counts, ids)
    managers = pool.managers
    groups = len(managers)
    single = managers[0] if groups == 1 else None
    cached_of = managers[0].num_cached_block.get
    size = managers[0].block_size
    skipping = pool.skipping_managers
    max_len = pool.max_model_len
    caching = pool.enable_caching
    lag = pool.hash_lag
    hash_block = pool.hash_block_size
    hashes = cols.append_block_hashes
    n = stop - start
    entries = zip(
        *_entry_columns(pool, cols, start, stop, t, single is not None),
        _part(cols.num_new_tokens, start, stop),
        _part(cols.num_lookahead_tokens, start, stop),
        strict=True,
    )
    for i, rid, req, blocks, base_t, base_h, computed, token, nh, num_new, look in entries:
        if req is None:
            break
        all_tokens = req.all_token_ids
        have = len(all_tokens)
        if have != base_t or have >= max_len or len(req.block_hashes) != base_h:
            break  # (at max_model_len: the token would pass it)
        main = computed + num_new
        if main > max_len:
            break
        need = main + look
        if need > max_len:
            need = max_len
        if caching:
            hashed = have + 1 - lag
            if (hashed if hashed > 0 else 0) // hash_block - base_h != nh:
                break  # a hash due and missing, or one too many: the general path says so
            cached = main if main < hashed else hashed
        elif nh:
            break  # (hashes are ignored without caching: the general path reads them)
        else:
            cached = 0
        if skipping and any(m.skips_blocks(rid, computed) for m in skipping):
            break
        if single is not None:
            if blocks is None:
                break  # (no block yet: a first allocation, the general path's)
            inside = len(blocks) * size >= need and (not caching or cached_of(rid, 0) >= cached // size)
        else:
            held = _inside(managers, rid, need, cached if caching else 0)
            if held is None:
                break
            inside = held
        if inside and not nh:  # inside its blocks: the update alone
            req.num_computed_tokens = computed
            all_tokens.append(token)
        elif (not nh or hashes[h] is not None) and grow_entry(  # (a None hash is no hash to grow_entry)
            pool, req, computed, main, need, cached, token, hashes[h] if nh else None, counts, i * groups, ids
        ):
            h += nh
        else:
            break
    else:
        return stop, t + n, h
    return i, t + i - start, h


def _entry_columns(
    pool: KVCachePool, cols: DecodeColumns, start: int, stop: int, t: int, single: bool
) -> tuple[Iterable[object], ...]:
    """What both loops read of entries ``start .. stop-1``, to zip: the entry, its
    request id, request (looked up in C as the loop reaches each entry), its blocks in
    a pool of one group (else ``None``), base tokens and hashes, computed count, token
    and hash count."""
    rids = _part(cols.request_ids, start, stop)
    return (
        range(start, stop),
        rids,
        map(pool.requests.get, rids),
        map(pool.managers[0].req_to_blocks.get, rids) if single else repeat(None, stop - start),
        _part(cols.base_num_tokens, start, stop),
        _part(cols.base_num_hashes, start, stop),
        _part(cols.num_computed_tokens, start, stop),
        _part(cols.append_token_ids, t, t + stop - start),
        _part(cols.num_append_hashes, start, stop),
    )


def _next_token_columns(pool: KVCachePool, cols: DecodeColumns, start: int, stop: int) -> bool:
    """Whether entries ``start .. stop-1`` are all a decode step's usual one (each
    request's next token: computed count at the position, one new token, no
    look-ahead, position below ``max_model_len``) in a caching pool of one group
    without skip rule or hash lag: a few passes in C."""
    if len(pool.managers) != 1 or pool.skipping_managers or not pool.enable_caching or pool.hash_lag:
        return False
    base_t = _part(cols.base_num_tokens, start, stop)
    n = stop - start
    return (
        _part(cols.num_new_tokens, start, stop).count(1) == n
        and _part(cols.num_lookahead_tokens, start, stop).count(0) == n
        and _part(cols.num_computed_tokens, start, stop) == base_t
        and max(base_t) < pool.max_model_len
    )


def _run_next_token(
    pool: KVCachePool, cols: DecodeColumns, start: int, stop: int, t: int, h: int, counts: list[int], ids: list[int],
) -> tuple[int, int, int]:  # fmt: skip
    """:func:`_run_plain`'s loop for entries :func:`_next_token_columns` vouched for:
    with the computed count at the position (so that after the update it is one short of
    the tokens), one new token and no look-ahead, the slots needed, the tokens hashed and
    those cached are all the tokens after it, at most ``max_model_len``.

    Besides the update alone (inside its blocks), the loop itself applies the two
    entries of a block's worth that :func:`grow_entry` would otherwise (as it would: the
    same calls to the block pool, in the same order): the first token of a block (one
    new block, nothing to cache) and the last (its hash appended, that block cached by
    :func:`_cache_one`). Any other entry is :func:`grow_entry`'s."""
    m = pool.managers[0]
    num_cached = m.num_cached_block
    cached_of = num_cached.get
    size, hash_block = m.block_size, pool.hash_block_size
    bp = pool.block_pool
    queue = bp.free_block_queue
    length = pool.config.hash_length
    hashes = cols.append_block_hashes
    n = stop - start
    entries = zip(*_entry_columns(pool, cols, start, stop, t, True), strict=True)
    for i, rid, req, blocks, base_t, base_h, computed, token, nh in entries:
        if req is None or blocks is None:
            break  # (no block yet: a first allocation, the general path's)
        all_tokens = req.all_token_ids
        have = len(all_tokens)
        if have != base_t or len(req.block_hashes) != base_h:
            break
        need = have + 1  # (also what is hashed, and so cached)
        if need // hash_block - base_h != nh:
            break  # a hash due and missing, or one too many: the general path says so
        held = len(blocks) * size
        full = need // size
        k = cached_of(rid, 0)
        if not nh:
            if held >= need and k >= full:
                req.num_computed_tokens = computed  # inside its blocks: the update alone
                all_tokens.append(token)
                continue
            if need == held + 1 and k >= full and held:
                # a block's first token (an admitted request: k >= full >= 1): one new
                # block, every full one already cached
                if not queue.num_free_blocks:
                    break  # a refusal: the general path counts it (and keeps the update)
                req.num_computed_tokens = computed
                all_tokens.append(token)
                new_blocks = bp.get_new_blocks(1)
                blocks += new_blocks
                counts[i] = 1
                ids.append(new_blocks[0].block_id)
                continue
        elif held >= need and k == full - 1 and (k or rid in num_cached):
            new_hash = hashes[h]
            if _hash_taken(new_hash, length):
                # a block's last token (an admitted request): its hash, that block cached
                req.num_computed_tokens = computed
                all_tokens.append(token)
                req.block_hashes.append(new_hash)
                h += 1
                if _cache_one(bp, req, m, k):
                    num_cached[rid] = full
                else:
                    pool.cache_full_request_blocks(req, need)
                continue
        if (not nh or hashes[h] is not None) and grow_entry(  # (a None hash is no hash to grow_entry)
            pool, req, computed, need, need, need, token, hashes[h] if nh else None, counts, i, ids
        ):
            h += nh
        else:
            break
    else:
        return stop, t + n, h
    return i, t + i - start, h


def _inside(managers: Sequence[SingleTypeKVCacheManager], rid: str, need: int, cached: int) -> bool | None:
    """Whether every group's blocks of ``rid`` cover ``need`` slots and its full blocks
    up to ``cached`` tokens are cached (``None``: a group holds no list for it yet)."""
    inside = True
    for m in managers:
        blocks = m.req_to_blocks.get(rid)
        if blocks is None:
            return None
        size = m.block_size
        if len(blocks) * size < need or m.num_cached_block.get(rid, 0) < cached // size:
            inside = False
    return inside


def _hash_taken(new_hash: object, length: int | None) -> bool:
    """Whether the update would take ``new_hash`` as a request's next block hash: a
    non-empty ``bytes`` of the pool's hash length (any length when it has none)."""
    return type(new_hash) is bytes and bool(new_hash) and (length is None or len(new_hash) == length)


def grow_entry(
    pool: KVCachePool, req: Request, computed: int, main: int, need: int, cached: int, token: int,
    new_hash: bytes | None, counts: list[int], at: int, ids: list[int],
) -> bool:  # fmt: skip
    """An entry that takes new blocks or caches full ones, applied as
    ``KVCachePool._allocate_without_hit`` would after the update (the blocks taken
    group by group, then the full ones cached): ``False``, with nothing changed, when
    its hash is not one the update would take or too few blocks are free (for the
    general path, which raises or refuses)."""
    if new_hash is not None and not _hash_taken(new_hash, pool.config.hash_length):
        return False
    rid = req.request_id
    bp = pool.block_pool
    managers = pool.managers
    first = managers[0]
    single = len(managers) == 1
    if single and rid in first.num_cached_block:  # (KVCachePool.num_to_take's)
        take = -(-need // first.block_size) - len(first.req_to_blocks[rid])
    else:
        take = pool.num_to_take(rid, need, computed, main)
    if take > 0 and take > bp.free_block_queue.num_free_blocks:
        return False  # a refusal: the general path counts it (and keeps the update)
    # Nothing below can fail: the update, the blocks taken, the full ones cached.
    req.num_computed_tokens = computed
    req.all_token_ids.append(token)
    if new_hash is not None:
        req.block_hashes.append(new_hash)
    for g, m in enumerate(managers) if not single or take > 0 else ():  # (one group taking none: no loop)
        blocks = m.req_to_blocks[rid]
        n = -(-need // m.block_size) - len(blocks)
        if n > 0:
            new_blocks = bp.get_new_blocks(n)
            blocks += new_blocks
            counts[at + g] = n
            ids += [b.block_id for b in new_blocks]
    if pool.enable_caching:
        k = first.num_cached_block.get(rid, 0)
        full = cached // first.block_size
        if not single or full > k + 1 or (full == k + 1 and not _cache_one(bp, req, first, k)):
            pool.cache_full_request_blocks(req, cached)
        elif full == k + 1:
            first.num_cached_block[rid] = full
        # (else nothing to cache, as cache_full_request_blocks would find)
    return True


def _cache_one(bp: BlockPool, req: Request, m: SingleTypeKVCacheManager, k: int) -> bool:
    """Block ``k`` of ``req``'s blocks of group ``m`` cached as ``BlockPool.cache_full_blocks``
    caches a run of one block, in a pool whose hashes are at that group's block size and
    whose events are vLLM 0.16's, for a request of the default cache namespace; ``False``,
    with nothing changed, for anything else (the general path's). The caller records
    the block as cached."""
    size, gid = m.block_size, m.group_id
    if bp.group_event_fields is not None or bp.hash_block_size != size or req.cache_prefix:
        return False
    block = m.req_to_blocks[req.request_id][k]
    if block.is_null:
        return False
    assert block.cached_hash is None, f"block {block.block_id} is already cached"
    hashes = req.block_hashes
    block_hash = hashes[k]
    block.cached_hash = block_hash
    block.cached_group = gid
    block_id = block.block_id
    cache = bp.cached_block_hash_to_block
    existing = cache.first[gid].setdefault(block_hash, block_id)
    if existing != block_id:
        cache.add_duplicate(block_hash, gid, existing, block_id)
    elif cache.hook is not None and cache.hook.gid == gid:
        cache.hook.added(block_hash)
    if bp.enable_kv_cache_events:
        lora = req.lora
        bp.kv_event_queue.append(
            block_stored(
                (block_hash,), hashes[k - 1] if k else None, tuple(req.all_token_ids[k * size : (k + 1) * size]),
                size, lora.adapter_id if lora else None, lora.name if lora else None,
            )
        )  # fmt: skip
    return True
