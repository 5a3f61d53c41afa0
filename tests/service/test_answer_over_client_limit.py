"""A keyed call whose answer is larger than the *client's* ``max_message_bytes`` (a
client configured below the server's limit, which is all the server keeps its answers
under), over real gRPC, both clients.

The server applies the call and answers; the client's gRPC refuses the answer,
RESOURCE_EXHAUSTED ("CLIENT: Received message larger than max"). That is the code of a
refusal that applied nothing (a full idempotency budget, a pool limit, the server's
own receive limit), so the caller was told an error for an allocation the server holds.
It is now OutcomeUnknownError (as a lost answer: a retry would get the same answer
again): the managers free such a call's requests and report them lost. The server
refusing a request larger than *its* limit ("SERVER: ...") applied nothing and stays
ResourceExhaustedError."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from kvcoord.client import AsyncKVCoordClient, KVCoordClient, OutcomeUnknownError, ResourceExhaustedError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate, follow_up
from support import held_blocks, pool_toml

TOKENS = list(range(8192))  # 2048 blocks of 4 tokens: a table of ~4 KB
LIMIT = 2048  # the small client's max_message_bytes


def _grow() -> pb.AllocateOp:
    """One more block for "r", its whole table in the answer (``return_table``): a
    request of about 130 bytes, an answer of about 4 KB."""
    sync = follow_up("r", TOKENS, [1, 2, 3, 4], num_computed_tokens=len(TOKENS))
    return pb.AllocateOp(request=sync, num_new_tokens=4, return_table=True)


@pytest.mark.parametrize("kind", ["blocking", "aio", "step-stream"])
def test_an_answer_over_the_clients_limit_is_an_unknown_outcome(
    make_server: Callable[..., InProcessServer], kind: str
) -> None:
    server = make_server(pool_toml("p", 4096, max_model_len=20000), max_message_bytes=200_000)
    with (
        KVCoordClient(server.address, timeout=10) as big,
        KVCoordClient(server.address, timeout=10, max_message_bytes=LIMIT) as small,
    ):
        # (the small client's own Attach: its Steps then go on a StepStream)
        s = small.attach("p", "sha256_cbor", 4, "0", lease_seconds=600)
        got = big.allocate("p", allocate("r", TOKENS, len(TOKENS)).allocate, s.session_id, s.fence)
        assert not got.result.refused
        op = _grow()
        told: Any = None
        if kind != "aio":
            try:
                if kind == "step-stream":
                    assert small._streamed  # (the server serves StepStream)
                    small.step("p", [pb.Operation(allocate=op)], s.session_id, s.fence)
                else:
                    small.allocate("p", op, s.session_id, s.fence)
            except Exception as err:  # noqa: BLE001 - what the caller was told
                told = err
        else:

            async def run() -> Any:
                async with AsyncKVCoordClient(server.address, timeout=10, max_message_bytes=LIMIT) as small:
                    try:
                        await small.allocate("p", op, s.session_id, s.fence)
                    except Exception as err:  # noqa: BLE001
                        return err
                return None

            told = asyncio.run(run())
        assert len(held_blocks(big, "p")["r"]) == 2049  # applied: one more block
        assert isinstance(told, OutcomeUnknownError), repr(told)  # (was: ResourceExhaustedError)
        assert "max_message_bytes" in str(told)
        # a request over the server's limit: refused by its gRPC, nothing applied
        with pytest.raises(ResourceExhaustedError) as refused:
            big.allocate("p", allocate("q", list(range(90_000)), 16).allocate, s.session_id, s.fence)
        assert not isinstance(refused.value, OutcomeUnknownError)
        assert "q" not in held_blocks(big, "p")
