"""Request builders for service tests."""

from __future__ import annotations

from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.v1 import allocator_pb2 as pb

NONE = none_hash("sha256_cbor", "0")


def hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    return BlockHasher("sha256_cbor", block_size, NONE).extend(tokens)


def new_request(rid: str, tokens: list[int], block_size: int = 4) -> pb.RequestSync:
    """The first sync of a request: its whole prompt and hashes."""
    return pb.RequestSync(
        request_id=rid, append_token_ids=tokens, append_block_hashes=hashes(tokens, block_size)
    )


def allocate(rid: str, tokens: list[int] | None, n: int, block_size: int = 4, **kw: object) -> pb.Operation:
    sync = new_request(rid, tokens, block_size) if tokens is not None else pb.RequestSync(request_id=rid)
    return pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=n, **kw))  # type: ignore[arg-type]
