"""A pool's state in parts over real gRPC (handover_parts.py), apart from a cluster: the
sender (``send_state``) against a peer that takes parts and one of the previous
release, which has no ``AdoptPoolParts`` (UNIMPLEMENTED); and the receiver's checks
(``check_header``, ``assemble``) of a stream that is not what its header announced.
The peers are gRPC servers in the test's process, on loopback, with a receive limit
as a replica's ``max_message_bytes``."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import pytest
from kvcoord.service.errors import ServiceError, Status, grpc_code
from kvcoord.service.handover_parts import (
    MESSAGE_ROOM,
    PART_BYTES,
    HandoverImpossible,
    accepted,
    assemble,
    check_header,
    part_bytes,
    send_state,
)
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

#: the peers' receive limit (a replica's max_message_bytes)
LIMIT = 64 * 1024


class _Peer(pb_grpc.ReplicasServicer):
    """Takes a state whole or in parts (``parts``: False, the previous release: no
    AdoptPoolParts registered) and remembers each state it got, by the call it came with."""

    def __init__(self, parts: bool) -> None:
        self.parts = parts
        #: (the call, its pool, from_replica and claim revision, the state)
        self.got: list[tuple[str, str, str, int, bytes]] = []

    async def AdoptPool(self, request: pb.AdoptPoolRequest, context: Any) -> pb.AdoptPoolResponse:  # noqa: N802
        self.got.append(
            ("AdoptPool", request.pool, request.from_replica, request.claim_revision, request.state)
        )
        return pb.AdoptPoolResponse(term=7)

    async def AdoptPoolParts(
        self, parts: AsyncIterator[pb.AdoptPoolPart], context: Any
    ) -> pb.AdoptPoolResponse:  # noqa: N802
        try:
            header = check_header(await anext(aiter(parts), None), LIMIT)
            await accepted(context)
            state = await assemble(parts, header)
        except ServiceError as exc:
            await context.abort(*grpc_code(exc))
        self.got.append(("AdoptPoolParts", header.pool, header.from_replica, header.claim_revision, state))
        return pb.AdoptPoolResponse(term=8)

    def handlers(self) -> grpc.GenericRpcHandler:
        table = {
            "AdoptPool": grpc.unary_unary_rpc_method_handler(
                self.AdoptPool,
                request_deserializer=pb.AdoptPoolRequest.FromString,
                response_serializer=pb.AdoptPoolResponse.SerializeToString,
            )
        }
        if self.parts:
            table["AdoptPoolParts"] = grpc.stream_unary_rpc_method_handler(
                self.AdoptPoolParts,
                request_deserializer=pb.AdoptPoolPart.FromString,
                response_serializer=pb.AdoptPoolResponse.SerializeToString,
            )
        return grpc.method_handlers_generic_handler("kvcoord.v1.Replicas", table)


async def _sent(
    peer: _Peer, state: bytes, sender_limit: int, peer_limit: int = LIMIT
) -> pb.AdoptPoolResponse:
    """``state`` sent by a replica whose max_message_bytes is ``sender_limit`` to ``peer``,
    which takes messages of ``peer_limit`` bytes at most."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", peer_limit)])
    server.add_generic_rpc_handlers((peer.handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            header = pb.AdoptPoolHeader(pool="p", from_replica="r0", claim_revision=3)
            return await send_state(channel, header, state, sender_limit, 10.0, (), "'r1' at test")
    finally:
        await server.stop(None)


def _state(n: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(n))


@pytest.mark.parametrize(
    "size", [1, LIMIT // 2, LIMIT - MESSAGE_ROOM, LIMIT - MESSAGE_ROOM + 1, 5 * LIMIT + 3]
)
def test_a_state_of_any_size_reaches_a_peer_that_takes_parts(size: int) -> None:
    """One that fits a part goes with AdoptPool (as to any release), a larger one in
    parts each under the peer's limit (one past a part's size: two parts); the peer
    gets it byte for byte."""
    peer = _Peer(parts=True)
    state = _state(size)
    answer = asyncio.run(_sent(peer, state, LIMIT))
    way = "AdoptPool" if size <= part_bytes(LIMIT) else "AdoptPoolParts"
    assert peer.got == [(way, "p", "r0", 3, state)] and answer.term == (7 if way == "AdoptPool" else 8)


def test_a_peer_of_the_previous_release_gets_what_fits_one_message() -> None:
    """UNIMPLEMENTED: a state larger than a part that fits one message of the peer's
    goes with AdoptPool; one that does not is HandoverImpossible, naming the peer and
    what to do, and the peer got nothing."""
    limit = 4 * PART_BYTES + MESSAGE_ROOM  # both replicas' max_message_bytes
    fits = _state(2 * PART_BYTES)  # larger than a part: parts first, then whole
    peer = _Peer(parts=False)
    answer = asyncio.run(_sent(peer, fits, limit, limit))
    assert peer.got == [("AdoptPool", "p", "r0", 3, fits)] and answer.term == 7
    peer = _Peer(parts=False)
    with pytest.raises(HandoverImpossible) as impossible:
        asyncio.run(_sent(peer, _state(4 * PART_BYTES + 1), limit, limit))
    assert impossible.value.reason == "peer_release"
    assert "'r1' at test answers UNIMPLEMENTED" in str(impossible.value)
    assert "upgrade that replica" in str(impossible.value)
    assert peer.got == []


def test_a_peer_with_a_lower_limit_is_impossible_and_says_so() -> None:
    """The sender's parts are larger than the peer's limit (a lower max_message_bytes
    there): RESOURCE_EXHAUSTED, told as HandoverImpossible ``peer_limit``."""
    peer = _Peer(parts=True)
    with pytest.raises(HandoverImpossible) as impossible:
        asyncio.run(_sent(peer, _state(40 * LIMIT), 16 * LIMIT))
    assert impossible.value.reason == "peer_limit" and "RESOURCE_EXHAUSTED" in str(impossible.value)
    assert peer.got == []


def _parts(state: bytes, size: int) -> list[pb.AdoptPoolPart]:
    header = pb.AdoptPoolHeader(
        pool="p",
        from_replica="r0",
        claim_revision=3,
        state_bytes=len(state),
        state_sha256=hashlib.sha256(state).digest(),
        part_bytes=size,
    )
    pieces = [pb.AdoptPoolPart(offset=o, data=state[o : o + size]) for o in range(0, len(state), size)]
    return [pb.AdoptPoolPart(header=header), *pieces]


async def _assembled(parts: Iterable[pb.AdoptPoolPart]) -> bytes:
    async def stream() -> AsyncIterator[pb.AdoptPoolPart]:
        for part in parts:
            yield part

    it = stream()
    header = check_header(await anext(it, None), LIMIT)
    return await assemble(it, header)


def _refused(parts: list[pb.AdoptPoolPart]) -> ServiceError:
    with pytest.raises(ServiceError) as refused:
        asyncio.run(_assembled(parts))
    return refused.value


def test_a_stream_unlike_its_header_is_refused_naming_why() -> None:
    state = _state(10_000)
    good = _parts(state, 3000)  # header and 4 pieces
    assert asyncio.run(_assembled(good)) == state
    cases = {
        "the stream ended after 9,000 of 10,000 bytes": good[:-1],
        "out of order": [good[0], good[2], good[1], *good[3:]],
        "a piece at offset 3,000 where 6,000 was due": [*good[:3], good[2], *good[3:]],
        "more than the 10,000 bytes announced": [*good, pb.AdoptPoolPart(offset=10_000, data=b"x")],
        "a second header": [good[0], good[0], *good[1:]],
        "a piece of 3,001 bytes": [good[0], pb.AdoptPoolPart(offset=0, data=state[:3001]), *good[2:]],
        "a piece of 0 bytes": [good[0], pb.AdoptPoolPart(offset=0), *good[1:]],
        "its SHA-256 differs": [*good[:2], pb.AdoptPoolPart(offset=3000, data=bytes(3000)), *good[3:]],
    }
    for why, parts in cases.items():
        refused = _refused(parts)
        assert refused.status is Status.INVALID and why in refused.message, (why, refused.message)
        assert "nothing adopted" in refused.message
    assert "starts with its header" in _refused(good[1:]).message
    assert "starts with its header" in _refused([]).message
    long_name = _parts(state, 3000)
    long_name[0].header.pool = "p" * 129
    assert "1 to 128 characters" in _refused(long_name).message
    short_digest = _parts(state, 3000)
    short_digest[0].header.state_sha256 = b"\0" * 31
    assert "state_sha256 is 31 bytes" in _refused(short_digest).message
    too_large = _parts(state, LIMIT - MESSAGE_ROOM + 1)
    assert _refused(too_large).status is Status.EXHAUSTED
