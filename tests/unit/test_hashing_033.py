"""vLLM 0.33's block hashes (kvcoord.client.hashing, profile vllm-0.33) equal the hashes
vLLM 0.33.0 recorded in the format-2 traces: tagged LoRA (with its path) and cache-salt
keys, and look-ahead hashes for EAGLE."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvcoord.client.hashing import BlockHasher, BlockHasher033, block_hasher, none_hash

DATA = Path(__file__).resolve().parents[1] / "conformance" / "data-vllm-0.33"


def _records(name: str) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    lines = (DATA / name).read_text().splitlines()
    return json.loads(lines[0]), (json.loads(line) for line in lines[1:])


def _replay_hashes(name: str, profile: str) -> tuple[int, int]:
    """Hash every request of a trace as its ops append tokens; (requests whose every
    hash equals vLLM's, requests)."""
    cfg, ops = _records(name)
    none = none_hash(cfg["hash_algo"], cfg["hash_seed"], profile=profile)
    assert none.hex() == cfg["none_hash"]
    hashers: dict[str, BlockHasher | BlockHasher033] = {}
    equal: dict[str, bool] = {}
    for op in ops:
        if op["op"] == "add_request":
            lora = op.get("lora")
            h = block_hasher(
                profile,
                cfg["hash_algo"],
                cfg["hash_block_size"],
                none,
                lora_name=lora["name"] if lora else None,
                lora_path=lora.get("path") if lora else None,
                cache_salt=op.get("cache_salt"),
                num_hash_lookahead_tokens=cfg["num_hash_lookahead_tokens"] if profile == "vllm-0.33" else 0,
            )
            hashers[op["req"]] = h
            got = [x.hex() for x in h.extend(op["prompt"])]
            equal[op["req"]] = got == op["expect"]["block_hashes"]
        elif op["op"] == "advance":
            got = [x.hex() for x in hashers[op["req"]].extend(op["append_token_ids"])]
            equal[op["req"]] = equal[op["req"]] and got == op["expect"]["new_block_hashes"]
    return sum(equal.values()), len(equal)


def test_lora_path_and_salt_hashes_equal_vllm_033() -> None:
    """Every request of the LoRA / cache-salt trace (sha256), prompt and decode blocks."""
    _, ops = _records("unitary_full16_sha256_lora_salt.jsonl")
    adds = [op for op in ops if op["op"] == "add_request"]
    assert any(op.get("lora") for op in adds) and any(op.get("cache_salt") for op in adds)
    ok, total = _replay_hashes("unitary_full16_sha256_lora_salt.jsonl", "vllm-0.33")
    assert ok == total == len(adds)


def test_016_hashes_differ_for_lora_and_salt() -> None:
    """The vllm-0.16 rules (untagged keys, no LoRA path) miss exactly the requests with
    a LoRA or a salt: the profile decides the hashes."""
    _, ops = _records("unitary_full16_sha256_lora_salt.jsonl")
    adds = [op for op in ops if op["op"] == "add_request"]
    plain = sum(1 for op in adds if not op.get("lora") and not op.get("cache_salt"))
    ok, total = _replay_hashes("unitary_full16_sha256_lora_salt.jsonl", "vllm-0.16")
    assert (ok, total) == (plain, len(adds))
    assert plain < len(adds)


@pytest.mark.parametrize("name", ["unitary_full16_eagle_k3.jsonl", "hybrid_full16_swa16_w64_eagle_k2.jsonl"])
def test_lookahead_hashes_equal_vllm_033(name: str) -> None:
    """EAGLE traces (num_hash_lookahead_tokens 1): each hash covers the next token and
    appears one token later, for prompts and decode steps alike."""
    cfg, _ = _records(name)
    assert cfg["num_hash_lookahead_tokens"] == 1
    ok, total = _replay_hashes(name, "vllm-0.33")
    assert ok == total > 0


def test_lookahead_needs_the_033_profile() -> None:
    with pytest.raises(ValueError, match="vllm-0.33"):
        block_hasher("vllm-0.16", "sha256", 16, b"x", num_hash_lookahead_tokens=1)
    with pytest.raises(ValueError, match="unknown profile"):
        block_hasher("vllm-0.20", "sha256", 16, b"x")


def test_lora_path_is_required_for_033() -> None:
    """Since vLLM 0.31 the path is part of the key: a LoRA without it is an error, not
    a hash that can never match."""
    with pytest.raises(ValueError, match="lora_path"):
        BlockHasher033("sha256", 16, b"x", lora_name="adapter-a")


def test_none_hash_default_seed_033() -> None:
    """vLLM 0.29+: with PYTHONHASHSEED unset, sha256 pools derive NONE_HASH from the fixed
    string "vllm-none-hash"; xxhash stays random (refused unless asked for)."""
    from kvcoord.client.hashing import RandomSeedError, hash_function

    assert none_hash("sha256_cbor", None, profile="vllm-0.33") == hash_function("sha256_cbor")(
        "vllm-none-hash"
    )
    with pytest.raises(RandomSeedError):
        none_hash("xxhash", None, profile="vllm-0.33")
    with pytest.raises(RandomSeedError):
        none_hash("sha256", None)


def test_truncate_forgets_hashes_covering_dropped_lookahead_tokens() -> None:
    """A rejected draft token invalidates the hash whose look-ahead covered it; hashing
    again from there gives what hashing the kept tokens at once gives."""
    h = BlockHasher033("sha256_cbor", 4, b"n" * 32, num_hash_lookahead_tokens=1)
    h.extend(list(range(9)))
    assert len(h.block_hashes) == 2
    h.truncate(8)
    assert len(h.block_hashes) == 1
    again = h.extend([99])
    fresh = BlockHasher033("sha256_cbor", 4, b"n" * 32, num_hash_lookahead_tokens=1)
    assert fresh.extend([*range(8), 99]) == h.block_hashes[:1] + again
