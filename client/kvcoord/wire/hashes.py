"""Hash settings both sides must agree on: a contract fact, not a computation (the
client's :mod:`kvcoord.client.hashing` computes the hashes)."""

from __future__ import annotations

__all__ = ["HASH_LENGTHS"]

#: Digest length in bytes of every block-hash function a pool may name (PoolConfig.hash_algo).
HASH_LENGTHS = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}
