"""The engine's check of block hashes given in bulk (a registration's, an update's of
several): every one ``bytes`` (no subclass, no other type), of the pool's hash length,
non-empty when the pool has none; the first bad one refuses the call, which changes
nothing. (The one-hash case has a path of its own: tests/unit/test_bad_input.py.)"""

from __future__ import annotations

import pytest
from kvcoord.engine import FullAttentionSpec, InvalidArgumentError, KVCacheConfig, KVCachePool
from kvcoord.engine.state import export_state


class _Bytes(bytes):
    pass


def _pool(hash_length: int | None) -> KVCachePool:
    return KVCachePool(
        KVCacheConfig(
            num_blocks=16, groups=(FullAttentionSpec(4),), hash_block_size=4, hash_length=hash_length
        )
    )


GOOD = [bytes([i]) * 8 for i in range(1, 4)]


@pytest.mark.parametrize("at", [0, 1, 2])
@pytest.mark.parametrize(
    ("hash_length", "bad", "match"),
    [
        (8, "x" * 8, "non-empty bytes"),
        (8, bytearray(8), "non-empty bytes"),
        (8, _Bytes(b"s" * 8), "non-empty bytes"),
        (8, None, "non-empty bytes"),
        (8, b"s" * 7, "8 bytes long, got one of 7 bytes"),
        (8, b"", "8 bytes long, got one of 0 bytes"),
        (None, b"", "non-empty bytes"),
        (None, 7, "non-empty bytes"),
    ],
)
def test_a_bad_hash_among_several_is_refused(
    hash_length: int | None, bad: object, match: str, at: int
) -> None:
    pool = _pool(hash_length)
    hashes: list[object] = list(GOOD)
    hashes[at] = bad
    before = export_state(pool)
    with pytest.raises(InvalidArgumentError, match=match):
        pool.add_request("a", list(range(12)), hashes)  # type: ignore[arg-type]
    assert export_state(pool) == before
    pool.add_request("b", [1] * 4, [GOOD[0]])
    with pytest.raises(InvalidArgumentError, match=match):
        pool.update_request("b", append_token_ids=[1] * 12, append_block_hashes=hashes)  # type: ignore[arg-type]
    assert pool.requests["b"].block_hashes == [GOOD[0]]


@pytest.mark.parametrize("hash_length", [8, None])
def test_good_hashes_in_bulk_are_taken(hash_length: int | None) -> None:
    pool = _pool(hash_length)
    pool.add_request("a", list(range(12)), list(GOOD))
    pool.update_request("a", append_token_ids=[1] * 8, append_block_hashes=[b"\x07" * 8, b"\x08" * 8])
    assert pool.requests["a"].block_hashes == [*GOOD, b"\x07" * 8, b"\x08" * 8]


@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize(
    ("hash_length", "bad", "match"),
    [
        (8, b"s" * 7, "8 bytes long, got one of 7 bytes"),
        (8, b"", "8 bytes long, got one of 0 bytes"),
        (8, bytearray(9), "8 bytes long, got one of 9 bytes"),  # (made bytes by as_bytes)
        (None, b"", "non-empty bytes"),
    ],
)
def test_hashes_typed_by_the_tracker_are_still_checked(
    hash_length: int | None, bad: object, match: str, at: int
) -> None:
    """The tracker's ``as_bytes`` makes every hash an exact ``bytes`` and marks the list
    (``BytesHashes``), so the engine skips its own type pass; the count and lengths are
    the engine's still: a bad one is refused with the error a plain list gets, and the
    request keeps a plain list of its own (not the marked one, which its maker may
    still read)."""
    from kvcoord.client.token_lists import as_bytes
    from kvcoord.engine import BytesHashes

    pool = _pool(hash_length)
    hashes: list[object] = list(GOOD)
    hashes[at] = bad
    marked = as_bytes(hashes)
    assert type(marked) is BytesHashes and all(type(h) is bytes for h in marked)
    before = export_state(pool)
    with pytest.raises(InvalidArgumentError, match=match):
        pool.add_request("a", list(range(12)), marked)
    with pytest.raises(InvalidArgumentError, match="expected 3 new block hashes"):
        pool.add_request("a", list(range(12)), as_bytes(GOOD[:2]))
    assert export_state(pool) == before
    good = as_bytes(GOOD)
    pool.add_request("a", list(range(12)), good)
    kept = pool.requests["a"].block_hashes
    assert type(kept) is list and kept is not good and kept == GOOD
    with pytest.raises(InvalidArgumentError, match=match):
        pool.update_request("a", append_token_ids=[1] * 12, append_block_hashes=as_bytes(hashes))
    assert pool.requests["a"].block_hashes == GOOD


@pytest.mark.parametrize("bad", [32, 5, "h" * 32, None, 1.5])
def test_the_tracker_refuses_a_hash_that_is_not_a_buffer(bad: object) -> None:
    """``as_bytes`` once made every non-``bytes`` hash ``bytes(h)``: an int 32 became 32
    zero bytes, a hash of the pool's length that any other such int matches (a hit on
    another request's blocks). A hash that is not a buffer is refused, as the engine
    refuses it; buffers (bytearray, memoryview, a bytes subclass) are still taken."""
    from kvcoord.client.token_lists import as_bytes

    with pytest.raises(InvalidArgumentError, match="non-empty bytes"):
        as_bytes([*GOOD[:1], bad])

    class Sub(bytes):
        pass

    taken = as_bytes([bytearray(GOOD[0]), memoryview(GOOD[1]), Sub(GOOD[2])])
    assert list(taken) == GOOD and all(type(h) is bytes for h in taken)
