"""Block hashes equal vLLM's: semantics.md §2 test vectors and extra-key rules."""

from __future__ import annotations

import pytest
from kvcoord.client.hashing import (
    BlockHasher,
    MultiModalItem,
    RandomSeedError,
    hash_function,
    none_hash,
)

TOKENS = [1, 2, 3, 4, 300, 70000, 128000, 5, 6, 7, 8, 9, 10]

VECTORS = {
    "sha256_cbor": (
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
        [
            "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
            "7977885be041b146e74120ab0ebe507641c57c15b5e8cc8b3f492d8e6ad753ba",
            "50123891c1146527162cd18022d790f81eb33a87fba0a460ad3f6fee43ba2bfb",
        ],
    ),
    "xxhash_cbor": (
        "1ebe36576dcb573f26b99533a20aaeca",
        [
            "0a8577df5ee3430515a8cc1f6e3ac52e",
            "f5ac421844a40d6d50fb0704fb2ec98f",
            "0979a199471602bf8580edac0dfde224",
        ],
    ),
    "sha256": (
        "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
        [
            "762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
            "f33ae825a2ff16f4432090efc49937a490d870ec2701a328aeb5100d6dc6ca1e",
            "d866dc530e20fdc39d567a3025f62c30f7902cfe3524957e8b2aa075536d6bcd",
        ],
    ),
    "xxhash": (
        "6fb31cc38bba6066183f7f2104b9c051",
        [
            "f3856cedd7e636094750c4546e855397",
            "095c2048f39f832776bb1f01b536bc97",
            "253be1e583d542459f098ccffe91067d",
        ],
    ),
}


@pytest.mark.parametrize("algo", sorted(VECTORS))
def test_vectors_seed_0(algo: str) -> None:
    """NONE_HASH and three chained block hashes match semantics.md §2.6 for every function."""
    want_none, want_blocks = VECTORS[algo]
    n = none_hash(algo, "0")
    assert n.hex() == want_none
    hasher = BlockHasher(algo, 4, n)
    assert [h.hex() for h in hasher.extend(TOKENS)] == want_blocks


def test_incremental_equals_one_shot_without_mm() -> None:
    """Appending token by token yields the same hashes as hashing all at once."""
    n = none_hash("sha256_cbor", "0")
    one = BlockHasher("sha256_cbor", 4, n)
    inc = BlockHasher("sha256_cbor", 4, n)
    one.extend(TOKENS)
    for t in TOKENS:
        inc.extend([t])
    assert inc.block_hashes == one.block_hashes


def test_lora_and_cache_salt() -> None:
    """LoRA name goes into every block, the salt only into block 0 (§2.6 vectors)."""
    n = none_hash("sha256_cbor", "0")
    h = BlockHasher("sha256_cbor", 4, n, lora_name="my-lora", cache_salt="tenant-a")
    assert [x.hex() for x in h.extend(TOKENS)] == [
        "22c6872a7bc0d739ef93f52f1b3b113179ab1ecf98ed6ee763586529b2c11837",
        "4798209b88da2d7a01f3c9355b663f9f54856d192863e3028a9136dcd955649f",
        "0c1ec97f92374c7b4bfe73d61fb397d0cd30ed10d1957ff3889bb28d62bca196",
    ]


def test_seed_42_block_size_8() -> None:
    """Another seed and block size (§2.6)."""
    n = none_hash("sha256_cbor", "42")
    assert n.hex() == "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780"
    h = BlockHasher("sha256_cbor", 8, n)
    assert h.extend([1, 2, 3, 4, 300, 70000, 128000, 5])[0].hex() == (
        "b3abc8b1f454edf5adabfd43df3f4608644edc0b603049bf3afbf9f41ac229a1"
    )


def test_encodings() -> None:
    """The encoders produce semantics.md's bytes for the seed string."""
    import pickle

    import cbor2

    assert cbor2.dumps("0", canonical=True).hex() == "6130"
    assert pickle.dumps("0", protocol=5).hex() == "80059505000000000000008c0130942e"
    assert cbor2.dumps((300, 70000, 128000, 5), canonical=True).hex() == "8419012c1a000111701a0001f40005"


def _keys_seen(
    algo: str, block_size: int, items: list[MultiModalItem], calls: list[list[int]]
) -> list[object]:
    seen: list[object] = []
    real = hash_function(algo)

    class Spy(BlockHasher):
        pass

    h = Spy(algo, block_size, b"\x00" * 32, mm_items=items)
    h._fn = lambda obj: (seen.append(obj[2]), real(obj))[1]  # type: ignore[method-assign, assignment]
    for c in calls:
        h.extend(c)
    return seen


def test_multimodal_cursor_quirk() -> None:
    """A later invocation starts the mm cursor at the last item (§2.5 verified example)."""
    a, b = MultiModalItem("A", 4, 1), MultiModalItem("B", 5, 1)
    incremental = _keys_seen("sha256_cbor", 4, [a, b], [[1, 2, 3, 4, 5, 6], [7, 8]])
    one_shot = _keys_seen("sha256_cbor", 4, [a, b], [[1, 2, 3, 4, 5, 6, 7, 8]])
    assert incremental == [None, ("B",)]
    assert one_shot == [None, ("A", "B")]


def test_multimodal_item_ending_at_block_start() -> None:
    """An item at (0,4) with a 4-token prompt later extended gives block 1 the key (A) (§2.5)."""
    a = MultiModalItem("A", 0, 4)
    assert _keys_seen("sha256_cbor", 4, [a], [[1, 2, 3, 4], [5, 6, 7, 8]]) == [("A",), ("A",)]
    assert _keys_seen("sha256_cbor", 4, [a], [[1, 2, 3, 4, 5, 6, 7, 8]]) == [("A",), None]


def test_prompt_embeds_bytes_are_keys() -> None:
    """Prompt-embedding rows of a block are one extra key, after the salt."""
    rows = [bytes([i]) * 2 for i in range(8)]
    seen: list[object] = []
    h = BlockHasher("sha256_cbor", 4, b"\x00" * 32, cache_salt="s", prompt_embeds=rows)
    real = h._fn
    h._fn = lambda obj: (seen.append(obj[2]), real(obj))[1]  # type: ignore[method-assign, assignment]
    h.extend(list(range(8)))
    assert seen == [("s", b"".join(rows[:4])), (b"".join(rows[4:]),)]


def test_random_seed_refused_unless_asked() -> None:
    """With no seed the hashes could never match another process: refused by default."""
    with pytest.raises(RandomSeedError, match="PYTHONHASHSEED"):
        none_hash("sha256_cbor", None)
    a = none_hash("sha256_cbor", None, allow_random=True)
    b = none_hash("sha256_cbor", None, allow_random=True)
    assert len(a) == 32 and a != b


def test_unknown_algorithm() -> None:
    """An unknown function name is refused with the list of valid ones."""
    with pytest.raises(ValueError, match="sha256_cbor"):
        hash_function("md5")
