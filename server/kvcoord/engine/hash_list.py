"""Block-hash lists at a group's granularity."""

from __future__ import annotations

from collections.abc import Sequence

from .types import BlockHashWithGroupId

__all__ = ["hashes_at_block_size", "key_with_group"]


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
