"""The prefix-cache map: cached block ids by (block hash, group), and the hook told of
keys entering or leaving it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from .hash_list import key_with_group
from .types import BlockHashWithGroupId


class KeyHook(Protocol):
    """Who is told when a key enters or leaves one group's ``first`` map (not when a
    key gains or loses a duplicate block: the key stays cached then)."""

    #: the group whose keys are reported
    gid: int

    def added(self, block_hash: bytes) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...


class BlockHashToBlockMap:
    """Cached block ids by (block hash, group).

    Several blocks may share a key (vLLM never de-duplicates, so block tables stay
    append-only); lookups return the earliest inserted survivor. ``first[g]`` maps a
    hash of group ``g`` to that block's id, so a lookup is one dict access with no key
    to build; the rare keys held by several blocks also list all of them, in insertion
    order, in ``more[g]``.

    Args:
        num_groups: number of KV cache groups.
    """

    __slots__ = ("more", "first", "hook")

    def __init__(self, num_groups: int) -> None:
        self.first: list[dict[bytes, int]] = [{} for _ in range(max(num_groups, 1))]
        self.more: list[dict[bytes, dict[int, None]]] = [{} for _ in range(max(num_groups, 1))]
        #: told of every key that enters or leaves ``first[hook.gid]`` (see
        #: :class:`KeyHook`): a server's cross-pool index of this map; ``None`` here.
        #: A replaced map (reset, teardown, state restore) starts without one.
        self.hook: KeyHook | None = None

    def get(self, block_hash: bytes, group_id: int) -> int | None:
        """The id of the earliest cached block still under this key, or ``None``."""
        return self.first[group_id].get(block_hash)

    def insert(self, block_hash: bytes, group_id: int, block_id: int) -> None:
        first = self.first[group_id].setdefault(block_hash, block_id)
        if first != block_id:
            self.add_duplicate(block_hash, group_id, first, block_id)
        elif (hook := self.hook) is not None and hook.gid == group_id:
            hook.added(block_hash)

    def add_duplicate(self, block_hash: bytes, group_id: int, first: int, block_id: int) -> None:
        """Record ``block_id`` as a later block under a key whose first block is ``first``."""
        more = self.more[group_id]
        ids = more.get(block_hash)
        if ids is None:
            more[block_hash] = {first: None, block_id: None}
        else:
            ids[block_id] = None

    def pop(self, block_hash: bytes, group_id: int, block_id: int) -> bool:
        """Drop ``block_id`` from the key; ``False`` if it was not there."""
        more = self.more[group_id]
        first = self.first[group_id]
        ids = more.get(block_hash) if more else None
        if ids is None:
            if first.get(block_hash) != block_id:
                return False
            del first[block_hash]
            if (hook := self.hook) is not None and hook.gid == group_id:
                hook.removed(block_hash)
            return True
        if block_id not in ids:
            return False
        del ids[block_id]
        first[block_hash] = next(iter(ids))
        if len(ids) == 1:
            del more[block_hash]
        return True

    def __len__(self) -> int:
        return sum(len(d) for d in self.first)

    def items(self) -> Iterator[tuple[BlockHashWithGroupId, list[int]]]:
        """``(hash ‖ group, block ids)`` per key: group order, then insertion order."""
        for gid, first in enumerate(self.first):
            more = self.more[gid]
            for block_hash, block_id in first.items():
                ids = more.get(block_hash)
                yield key_with_group(block_hash, gid), list(ids) if ids is not None else [block_id]

    def block_ids(self) -> Iterator[int]:
        """Every cached block id (unordered)."""
        for gid, first in enumerate(self.first):
            more = self.more[gid]
            yield from first.values()
            for ids in more.values():
                yield from list(ids)[1:]
