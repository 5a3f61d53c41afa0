"""Block-hash lists at a group's granularity."""

from __future__ import annotations

from collections.abc import Sequence

from .types import BlockHashWithGroupId

__all__ = [
    "NAMESPACE_PREFIX_BYTES",
    "PrefixedHashes",
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


def request_keys(block_hashes: Sequence[bytes], prefix: bytes) -> Sequence[bytes]:
    """The cache keys of a request's fine hashes: the hashes themselves without a
    namespace prefix (vLLM's keys, untouched), else a :class:`PrefixedHashes` view."""
    return PrefixedHashes(block_hashes, prefix) if prefix else block_hashes


def hashes_at_block_size(fine: Sequence[bytes], hash_block_size: int, block_size: int) -> Sequence[bytes]:
    """The hash list of a group whose blocks are ``block_size`` tokens.

    Args:
        fine: hashes at ``hash_block_size`` granularity.
        hash_block_size: token count of one fine hash.
        block_size: the group's block size, a multiple of ``hash_block_size``.

    Returns:
        ``fine`` itself when the sizes are equal, else a lazy merged view whose
        incomplete tail is dropped.
    """
    if block_size == hash_block_size:
        return fine
    return _MergedHashes(fine, block_size // hash_block_size)
