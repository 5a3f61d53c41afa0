"""A pool's state handed over in parts (``Replicas.AdoptPoolParts``).

The receiving replica's ``server.max_message_bytes`` bounds every message it receives
(16 MiB by default), and a pool's state takes 100-200 bytes per block in use (53 MB
for 261,120 blocks of 16 tokens, each held). Sent whole in one ``AdoptPool``, such a
state was refused RESOURCE_EXHAUSTED at every try, and a replica told to leave could
not hand the pool over. Now the sender (:func:`send_state`) sends a state that fits one part with
``AdoptPool`` as before, and a larger one as a header and pieces of at most
:data:`PART_BYTES` (less when its own max_message_bytes is lower: the replicas of a
cluster share their configuration); the receiver (:func:`assemble`) puts the pieces
together, in order, and checks their size and SHA-256 before anything is adopted.

A peer of a release without ``AdoptPoolParts`` answers UNIMPLEMENTED (a rolling
upgrade): the state goes with ``AdoptPool`` when it fits one message, else the handover
cannot happen, and says why (:class:`HandoverImpossible`); so does a peer that refuses
the parts RESOURCE_EXHAUSTED (its max_message_bytes is lower than this replica's).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from .bounds import MAX_NAME_LENGTH
from .errors import ServiceError, Status

__all__ = [
    "MESSAGE_ROOM",
    "PART_BYTES",
    "HandoverImpossible",
    "HandoverPauses",
    "accepted",
    "assemble",
    "check_header",
    "part_bytes",
    "send_state",
]

logger = logging.getLogger(__name__)

#: the longest piece of a state a part carries
PART_BYTES = 1 << 20
#: room left in a message beside its piece (the header: pool name, replica id, digest,
#: counts; a piece's offset; protobuf's framing takes a few bytes of it)
MESSAGE_ROOM = 4096
#: the longest replica id a header may name (a replica's id is a host name and an index)
MAX_REPLICA_ID_LENGTH = 256
#: a state's digest: SHA-256
DIGEST_BYTES = 32
#: the entry of a callee's initial metadata that accepts a stream's header: the caller
#: sends the pieces only once it has it
ACCEPTED = ("kvcoord-handover", "header-accepted")


class HandoverImpossible(Exception):
    """A handover that cannot happen as the replicas are now (the peer's release or its
    max_message_bytes): the pool stays here, and it is tried again only after a pause.

    Args:
        reason: ``peer_release`` (the peer takes no parts, and the state does not fit
            one message) or ``peer_limit`` (the peer refused it RESOURCE_EXHAUSTED).
        message: what happened and what to do, for the log.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


#: seconds before a rebalance tries a failed handover to the same replica again,
#: doubled at each failure up to the second (a leave tries anyway): any failure, and one
#: that cannot happen as the replicas are (HandoverImpossible). Was: tried again at the
#: next pass of the watch, which the failure's own claim, put again, started at once: a
#: large pool refused RESOURCE_EXHAUSTED was exported and sent again several times a
#: second (3 to 17 seen), unserved during each try, for as long as the joiner was there
RETRY_PAUSE = (1.0, 30.0)
HANDOVER_PAUSE = (30.0, 600.0)
#: kvcoord_handovers_failed's reasons
REASONS = ("peer_release", "peer_limit", "other")


class HandoverPauses:
    """A replica's failed handovers: counted by why (:attr:`failures`, a metric), and
    paused per pool and target (a rebalance tries one again once its pause is over)."""

    def __init__(self) -> None:
        self.failures = dict.fromkeys(REASONS, 0)
        #: pool -> (the target's replica id, when it may be tried again, the pause)
        self._paused: dict[str, tuple[str, float, float]] = {}

    def pausing(self, pool: str, target: str, now: float) -> bool:
        """Whether the handover of ``pool`` to ``target`` waits (another target: no)."""
        paused = self._paused.get(pool)
        return paused is not None and paused[0] == target and now < paused[1]

    def failed(self, pool: str, target: str, exc: BaseException, now: float) -> None:
        """Count and pause a failed handover; one that cannot happen is said why."""
        impossible = isinstance(exc, HandoverImpossible)
        self.failures[exc.reason if isinstance(exc, HandoverImpossible) else "other"] += 1
        first, longest = HANDOVER_PAUSE if impossible else RETRY_PAUSE
        last = self._paused.get(pool)
        pause = min(longest, max(first, 2 * last[2])) if last is not None and last[0] == target else first
        self._paused[pool] = (target, now + pause, pause)
        if impossible:
            logger.error(
                "pool %s cannot be handed over to replica %s (tried again in %.0f s at the earliest): %s",
                pool, target, pause, exc,
            )  # fmt: skip

    def succeeded(self, pool: str) -> None:
        self._paused.pop(pool, None)


def part_bytes(max_message_bytes: int) -> int:
    """The longest piece sent in one part by a replica whose max_message_bytes is this."""
    return max(1, min(PART_BYTES, max_message_bytes - MESSAGE_ROOM))


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


async def _parts(
    started: list[grpc.aio.StreamUnaryCall[pb.AdoptPoolPart, pb.AdoptPoolResponse]],
    header: pb.AdoptPoolHeader,
    state: bytes,
    size: int,
) -> AsyncIterator[pb.AdoptPoolPart]:
    """The parts of a stream: ``header``, then the pieces of ``state`` (of ``size``), only
    once the callee has accepted the header (its initial metadata: :func:`accepted`) on
    the call (``started[0]``, set as it starts). A callee refusing the header (its limit,
    the pool's placement) ends the call before a piece is written, so its status reaches
    the caller as sent: a piece written into a call the callee had ended made gRPC's
    asyncio client report INTERNAL ("Internal error from Core") in its place (a peer's
    RESOURCE_EXHAUSTED told as "other" in CI)."""
    yield pb.AdoptPoolPart(header=header)
    call = started[0]
    # (resolved also when the callee ends the call instead, without this entry: then its
    # status may not be set yet, and a piece written now could meet the call ended)
    if ACCEPTED not in tuple(await call.initial_metadata() or ()):
        return
    for offset in range(0, len(state), size):
        yield pb.AdoptPoolPart(offset=offset, data=state[offset : offset + size])


async def accepted(context: grpc.aio.ServicerContext[pb.AdoptPoolPart, pb.AdoptPoolResponse]) -> None:
    """The callee's side of :func:`_parts`: the header is accepted, the pieces may
    come (the initial metadata, holding :data:`ACCEPTED`)."""
    await context.send_initial_metadata((ACCEPTED,))


async def send_state(
    channel: grpc.aio.Channel,
    header: pb.AdoptPoolHeader,
    state: bytes,
    max_message_bytes: int,
    timeout: float,
    metadata: Sequence[tuple[str, str]],
    peer: str,
) -> pb.AdoptPoolResponse:
    """Send ``state``, the pool ``header`` names (its pool, from_replica and
    claim_revision; the rest is filled in here), to the replica at the end of
    ``channel`` (``peer`` names it in errors): with ``AdoptPool`` when it fits one part,
    else in parts (``AdoptPoolParts``), each under ``max_message_bytes`` (this
    replica's own). In parts, one part at a time is copied from ``state``.

    Raises:
        HandoverImpossible: the peer takes no parts and the state does not fit one
            message; or the peer refused it RESOURCE_EXHAUSTED.
        grpc.aio.AioRpcError: any other failure of the call.
    """
    stub = pb_grpc.ReplicasStub(channel)  # type: ignore[no-untyped-call]
    size = part_bytes(max_message_bytes)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    async def whole() -> pb.AdoptPoolResponse:
        request = pb.AdoptPoolRequest(
            pool=header.pool,
            state=state,
            from_replica=header.from_replica,
            claim_revision=header.claim_revision,
        )
        return await stub.AdoptPool(  # type: ignore[no-any-return]
            request, timeout=max(0.0, deadline - loop.time()), metadata=metadata
        )

    pool = header.pool[:200]
    try:
        if len(state) <= size:
            return await whole()
        header.state_bytes = len(state)
        header.state_sha256 = await asyncio.to_thread(_sha256, state)  # (hashlib lets go of the GIL)
        header.part_bytes = size
        try:
            started: list[grpc.aio.StreamUnaryCall[pb.AdoptPoolPart, pb.AdoptPoolResponse]] = []
            call = stub.AdoptPoolParts(
                _parts(started, header, state, size),
                timeout=max(0.0, deadline - loop.time()),
                metadata=metadata,
            )
            started.append(call)  # (before the parts are read: the first await is below)
            return await call  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        if len(state) + MESSAGE_ROOM > max_message_bytes:
            raise HandoverImpossible(
                "peer_release",
                f"replica {peer} answers UNIMPLEMENTED to Replicas.AdoptPoolParts: it runs an earlier kvcoord "
                f"release, which takes a pool's state in one message only, and the state of pool {pool!r} is "
                f"{len(state):,} bytes, past max_message_bytes ({max_message_bytes:,}): upgrade that replica "
                "(the pool stays here meanwhile)",
            )
        return await whole()
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        raise HandoverImpossible(
            "peer_limit",
            f"replica {peer} refused the state of pool {pool!r} ({len(state):,} bytes, in parts of at most "
            f"{size:,}) RESOURCE_EXHAUSTED: {(exc.details() or '')[:500]} (a replica's max_message_bytes lower "
            "than this one's: give the replicas the same; or another of its limits)",
        ) from None


def _invalid(header: pb.AdoptPoolHeader, why: str) -> ServiceError:
    return ServiceError(
        Status.INVALID,
        f"the handed-over state of pool {header.pool[:200]!r} is refused, nothing adopted: {why}",
    )


def check_header(part: pb.AdoptPoolPart | None, max_message_bytes: int) -> pb.AdoptPoolHeader:
    """The header of a stream whose first part is ``part`` (None: no part came).

    Raises:
        ServiceError: INVALID_ARGUMENT (no header, or one past its bounds);
            RESOURCE_EXHAUSTED (its pieces would not fit ``max_message_bytes``).
    """
    if part is None or not part.HasField("header") or part.data or part.offset:
        raise ServiceError(Status.INVALID, "an AdoptPoolParts stream starts with its header, alone")
    header = part.header
    if not header.pool or len(header.pool) > MAX_NAME_LENGTH:
        raise ServiceError(Status.INVALID, f"AdoptPoolHeader.pool must be 1 to {MAX_NAME_LENGTH} characters")
    if len(header.from_replica) > MAX_REPLICA_ID_LENGTH:
        raise _invalid(header, f"from_replica is longer than {MAX_REPLICA_ID_LENGTH} characters")
    if len(header.state_sha256) != DIGEST_BYTES:
        raise _invalid(header, f"state_sha256 is {len(header.state_sha256)} bytes, not {DIGEST_BYTES}")
    if not header.state_bytes or not header.part_bytes:
        raise _invalid(header, "state_bytes and part_bytes must be positive")
    if header.part_bytes + MESSAGE_ROOM > max_message_bytes:
        raise ServiceError(
            Status.EXHAUSTED,
            f"pieces of {header.part_bytes:,} bytes do not fit this replica's max_message_bytes "
            f"({max_message_bytes:,}): pool {header.pool[:200]!r} not adopted",
        )
    return header


async def assemble(parts: AsyncIterator[pb.AdoptPoolPart], header: pb.AdoptPoolHeader) -> bytes:
    """The state the pieces after ``header`` (read already) make, checked: in order,
    each within part_bytes, exactly state_bytes in all, matching the digest. Its pieces
    are kept as they come and joined once.

    Raises:
        ServiceError: INVALID_ARGUMENT, naming what is wrong (nothing is adopted).
    """
    pieces: list[bytes] = []
    got = 0
    async for part in parts:
        if part.HasField("header"):
            raise _invalid(header, "a second header")
        data = part.data
        if part.offset != got:
            raise _invalid(header, f"a piece at offset {part.offset:,} where {got:,} was due (out of order)")
        if not data or len(data) > header.part_bytes:
            raise _invalid(header, f"a piece of {len(data):,} bytes (1 to {header.part_bytes:,} allowed)")
        if got + len(data) > header.state_bytes:
            raise _invalid(header, f"more than the {header.state_bytes:,} bytes announced")
        pieces.append(data)
        got += len(data)
    if got != header.state_bytes:
        raise _invalid(header, f"the stream ended after {got:,} of {header.state_bytes:,} bytes")
    state = b"".join(pieces)
    pieces.clear()
    if await asyncio.to_thread(_sha256, state) != header.state_sha256:
        raise _invalid(header, "its SHA-256 differs from the header's")
    return state
