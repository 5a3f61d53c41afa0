"""Block-hash lists at a group's granularity."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from ._mypyc import mypyc_attr
from .errors import InvalidArgumentError
from .types import BlockHashWithGroupId

__all__ = [
    "NAMESPACE_PREFIX_BYTES",
    "PrefixedHashes",
    "SharedHashes",
    "hashes_at_block_size",
    "key_with_group",
    "request_keys",
]

#: length of a cache namespace's key prefix (RequestTable.namespace_prefix)
NAMESPACE_PREFIX_BYTES = 4


def key_with_group(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    """``hash ‖ uint32_be(group)``: the hash-map key of a cached block."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))


class _MergedHashes(Sequence[bytes]):
    """Fine hashes seen ``k`` at a time: hash ``i`` is the concatenation of ``i*k .. i*k+k-1``."""

    __slots__ = ("_fine", "_k", "_len")

    def __init__(self, fine: Sequence[bytes], k: int) -> None:
        self._fine = fine
        self._k = k
        self._len = len(fine) // k

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        k = self._k
        return b"".join(self._fine[i * k : i * k + k])


class PrefixedHashes(Sequence[bytes]):
    """Hashes seen with a cache-namespace prefix: item ``i`` is ``prefix + hashes[i]``.

    A namespaced request's lookups and cached blocks use these keys, so they can
    never equal a key of another namespace: prefixes are distinct and of one fixed
    length, and un-namespaced keys (no prefix) are shorter (every hash of a pool has
    the pool's hash length).
    """

    __slots__ = ("_hashes", "_prefix")

    def __init__(self, hashes: Sequence[bytes], prefix: bytes) -> None:
        self._hashes = hashes
        self._prefix = prefix

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            p = self._prefix
            return [p + h for h in self._hashes[i]]
        return self._prefix + self._hashes[i]


@mypyc_attr(native_class=False)  # a list: mypyc compiles no subclass of one
class SharedHashes(list[bytes]):
    """One prompt's hashes read by many pools in one call (ScorePools), never changed.

    The same items as the list it copies, so every search reads it as it reads any
    hash list. What each pool would otherwise derive from the hashes again is derived
    once and kept here for the call's other pools: the result of each distinct check
    (:meth:`checked`), the keys under each namespace prefix (:func:`request_keys`) and
    the merged list at each coarser block size (:func:`hashes_at_block_size`), as plain
    lists whose ``bytes`` items cache their own hash for every dict that looks them up.
    It holds derived values of its own items only: nothing of any pool, so it cannot go
    stale; it lives as long as the call that made it.
    """

    __slots__ = ("_derived",)

    def __init__(self, hashes: Sequence[bytes] = ()) -> None:
        super().__init__(hashes)
        self._derived: dict[object, object] = {}

    def checked(self, key: object, check: Callable[[], object]) -> None:
        """Run ``check`` once per ``key``; later calls with the same key return, or
        raise the same :class:`InvalidArgumentError` again (a new one, same message)."""
        derived = self._derived
        if key not in derived:
            try:
                check()
                derived[key] = None
            except InvalidArgumentError as exc:
                derived[key] = (type(exc), str(exc))
        failure = derived[key]
        if failure is not None:
            kind, message = cast("tuple[type[InvalidArgumentError], str]", failure)
            raise kind(message)

    def passed(self, key: object) -> bool:
        """Whether the check of ``key`` already ran in this call and passed."""
        derived = self._derived
        return key in derived and derived[key] is None

    def prefixed(self, prefix: bytes) -> SharedHashes:
        """``prefix + h`` for every hash (as :class:`PrefixedHashes` reads them), once."""
        key = ("prefix", prefix)
        out = self._derived.get(key)
        if out is None:
            out = self._derived[key] = SharedHashes([prefix + h for h in self])
        return out  # type: ignore[return-value]

    def merged(self, k: int) -> list[bytes]:
        """The hashes joined ``k`` at a time, incomplete tail dropped (as
        :class:`_MergedHashes` reads them), once."""
        key = ("merged", k)
        out = self._derived.get(key)
        if out is None:
            join = b"".join
            out = self._derived[key] = [join(self[i : i + k]) for i in range(0, len(self) - k + 1, k)]
        return out  # type: ignore[return-value]


def request_keys(block_hashes: Sequence[bytes], prefix: bytes) -> Sequence[bytes]:
    """The cache keys of a request's fine hashes: the hashes themselves without a
    namespace prefix (vLLM's keys, untouched), else a :class:`PrefixedHashes` view
    (for :class:`SharedHashes`, its shared prefixed copy)."""
    if not prefix:
        return block_hashes
    if type(block_hashes) is SharedHashes:
        return block_hashes.prefixed(prefix)
    return PrefixedHashes(block_hashes, prefix)


def hashes_at_block_size(fine: Sequence[bytes], hash_block_size: int, block_size: int) -> Sequence[bytes]:
    """The hash list of a group whose blocks are ``block_size`` tokens.

    Args:
        fine: hashes at ``hash_block_size`` granularity.
        hash_block_size: token count of one fine hash.
        block_size: the group's block size, a multiple of ``hash_block_size``.

    Returns:
        ``fine`` itself when the sizes are equal, else a lazy merged view whose
        incomplete tail is dropped (for :class:`SharedHashes`, its shared merged list).
    """
    if block_size == hash_block_size:
        return fine
    if type(fine) is SharedHashes:
        return fine.merged(block_size // hash_block_size)
    return _MergedHashes(fine, block_size // hash_block_size)
