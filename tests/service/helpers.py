"""Request builders for service tests (the positioned-sync protocol: every request is
registered by a ``new_request`` sync and later syncs name the position they apply at)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.v1 import allocator_pb2 as pb

NONE = none_hash("sha256_cbor", "0")


def hashes(tokens: Sequence[int], block_size: int = 4) -> list[bytes]:
    return BlockHasher("sha256_cbor", block_size, NONE).extend(list(tokens))


def attach(
    client: Any, pool: str = "p", block_size: int = 4, seed: str = "0", **kw: Any
) -> tuple[str, pb.Fence]:
    """A session on ``pool`` (sha256_cbor hashing): (session_id, fence)."""
    r = client.attach(pool, "sha256_cbor", block_size, seed, **kw)
    return r.session_id, r.fence


def new_request(rid: str, tokens: Sequence[int], block_size: int = 4) -> pb.RequestSync:
    """The first sync of a request (new_request, base 0): its whole prompt and hashes."""
    return pb.RequestSync(
        request_id=rid,
        append_token_ids=list(tokens),
        append_block_hashes=hashes(tokens, block_size),
        new_request=True,
    )


def follow_up(
    rid: str,
    held: Sequence[int],
    append: Sequence[int] = (),
    num_computed_tokens: int | None = None,
    block_size: int = 4,
) -> pb.RequestSync:
    """A later sync of a request whose tokens on the server are ``held``: positioned at
    len(held) tokens / len(held) // block_size hashes, appending ``append`` and the
    hashes of the blocks it completes."""
    base_hashes = len(held) // block_size
    sync = pb.RequestSync(
        request_id=rid,
        append_token_ids=list(append),
        append_block_hashes=hashes(list(held) + list(append), block_size)[base_hashes:],
        base_num_tokens=len(held),
        base_num_hashes=base_hashes,
    )
    if num_computed_tokens is not None:
        sync.num_computed_tokens = num_computed_tokens
    return sync


def allocate(
    rid: str,
    tokens: Sequence[int] | None,
    n: int,
    block_size: int = 4,
    held: Sequence[int] | None = None,
    **kw: object,
) -> pb.Operation:
    """An AllocateOp (as an Operation): registering ``rid`` with prompt ``tokens``, or,
    with ``tokens=None``, naming the request already held at ``held`` tokens."""
    if tokens is not None:
        sync = new_request(rid, tokens, block_size)
    else:
        sync = follow_up(rid, held or (), block_size=block_size)
    return pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=n, **kw))  # type: ignore[arg-type]


def one_block_allocations(prefix: str, n: int) -> list[pb.Operation]:
    """``n`` operations, each registering request ``{prefix}{i}`` (4 tokens, no hashes)
    and allocating its one block: a large Step of cheap operations."""
    return [
        pb.Operation(
            allocate=pb.AllocateOp(
                request=pb.RequestSync(
                    request_id=f"{prefix}{i}", new_request=True, append_token_ids=[1, 2, 3, 4]
                ),
                num_new_tokens=4,
            )
        )
        for i in range(n)
    ]
