"""ScorePools answers without block ids, encoded straight to protobuf bytes.

A router's ScorePools answer lists every pool scored (64 pools: 64 ``PoolScore``
messages), and building those messages field by field, then serializing them, was the
largest part of the handler after scoring itself. A pool's score varies only in three
fields (``hit_tokens``, ``num_free_blocks``, ``usage``); its name, block total and
fence change only when the pool is created again. :class:`ScoreEncoder` keeps those
fixed parts encoded per pool and joins each answer from them and the three varying
fields, byte for byte what ``ScorePoolsResponse.SerializeToString()`` writes
(proto3: fields in number order, zeros left out), so clients parse the same message.

Answers with block ids or a reservation keep the message path (:func:`scores_to_pb`); the
rest of ScorePools' wire (prompts read, reservations and their counters written) is here too.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import hit_to_pb

from .pool_service import PoolScore, ScoreSettings, UnscoredPool, score_settings
from .wire_slices import encode_varint

if TYPE_CHECKING:  # pragma: no cover
    from kvcoord.engine.reservations import Reservations

    from .scoring import ReservationMade

__all__ = [
    "ScoreEncoder",
    "prompts_from_pb",
    "reservation_stats_to_pb",
    "reservation_to_pb",
    "scores_to_pb",
]

_pack_double = struct.Struct("<d").pack
_ZERO_DOUBLE = bytes(8)


#: small varints, encoded once (hit lengths, free blocks and lengths are mostly small)
_SMALL = [encode_varint(n) for n in range(1 << 14)]


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes or message) with its tag byte."""
    return bytes((tag,)) + encode_varint(len(payload)) + payload


class ScoreEncoder:
    """Encodes ScorePools answers without block ids (see the module's docstring).

    Args:
        max_pools: fixed parts kept at most (pools deleted or created again leave
            theirs behind: past this many, all are dropped and encoded again).
    """

    def __init__(self, max_pools: int = 4096) -> None:
        self.max_pools = max_pools
        #: (pool, num_total_blocks, instance_id, incarnation) -> (name field, fields 5 and 7)
        self._fixed: dict[tuple[str, int, str, int], tuple[bytes, bytes]] = {}

    def encode(self, scores: Sequence[PoolScore], unscored: Sequence[UnscoredPool]) -> bytes:
        """The bytes of ``ScorePoolsResponse(scores=..., unscored=...)``, each score's
        ``hit`` left unset (no block ids)."""
        fixed = self._fixed
        small = _SMALL
        out: list[bytes] = []
        append = out.append
        for s in scores:
            fence = s.fence
            key = (s.pool, s.num_total_blocks, fence.instance_id, fence.incarnation)
            parts = fixed.get(key)
            if parts is None:
                parts = self._fixed_parts(key)
            head, tail = parts
            hit = s.hit.num_tokens
            free = s.num_free_blocks
            usage = _pack_double(s.usage)
            # (the varints inline: a call per field costs as much as the rest of a score)
            body = b"".join(
                (
                    head,
                    (b"\x10" + (small[hit] if hit < 16384 else encode_varint(hit))) if hit else b"",
                    (b"\x18" + (small[free] if free < 16384 else encode_varint(free))) if free else b"",
                    b"\x21" + usage if usage != _ZERO_DOUBLE else b"",
                    tail,
                )
            )
            size = len(body)
            append(b"\x0a")
            append(small[size] if size < 16384 else encode_varint(size))
            append(body)
        for u in unscored:
            append(
                _field(
                    0x12, pb.UnscoredPool(pool=u.pool, reason=u.reason, message=u.message).SerializeToString()
                )
            )
        return b"".join(out)

    def _fixed_parts(self, key: tuple[str, int, str, int]) -> tuple[bytes, bytes]:
        pool, total, instance_id, incarnation = key
        if len(self._fixed) >= self.max_pools:
            self._fixed.clear()
        fence = (_field(0x0A, instance_id.encode()) if instance_id else b"") + (
            b"\x10" + encode_varint(incarnation) if incarnation else b""
        )
        head = _field(0x0A, pool.encode()) if pool else b""
        # the fence is always present: the message path sets its fields in place
        tail = (b"\x28" + encode_varint(total) if total else b"") + _field(0x3A, fence)
        parts = self._fixed[key] = (head, tail)
        return parts


# -- ScorePools ----------------------------------------------------------------------
def prompts_from_pb(prompts: Iterable[pb.HashedPrompt]) -> list[tuple[ScoreSettings, Sequence[bytes]]]:
    """Each prompt's hash settings (as PoolConfig spells them, with its profile and
    look-ahead: :func:`score_settings`) and its hashes, copied out of the message once
    (every pool scored reads them; each read of a repeated protobuf field makes new
    bytes objects).

    Raises:
        ServiceError: INVALID_ARGUMENT for an unknown profile or look-ahead outside vllm-0.33.
    """
    return [
        (
            score_settings(
                (p.hash_algo, p.hash_block_size, p.hash_seed), p.profile, p.num_hash_lookahead_tokens
            ),
            list(p.block_hashes),
        )
        for p in prompts
    ]


def scores_to_pb(
    scores: Sequence[PoolScore], unscored: Sequence[UnscoredPool], include_block_ids: bool
) -> pb.ScorePoolsResponse:
    out = pb.ScorePoolsResponse(
        unscored=[pb.UnscoredPool(pool=u.pool, reason=u.reason, message=u.message) for u in unscored]
    )
    add = out.scores.add
    for sc in scores:
        m = add(
            pool=sc.pool,
            hit_tokens=sc.hit.num_tokens,
            num_free_blocks=sc.num_free_blocks,
            usage=sc.usage,
            num_total_blocks=sc.num_total_blocks,
        )
        # set in place: a Fence message built per pool and copied in costs a third more
        fence = m.fence
        fence.instance_id = sc.fence.instance_id
        fence.incarnation = sc.fence.incarnation
        if include_block_ids:
            m.hit.CopyFrom(hit_to_pb(sc.hit))
    return out


def reservation_to_pb(made: ReservationMade) -> pb.Reservation:
    return pb.Reservation(
        reservation_id=made.reservation_id,
        pool=made.pool,
        hit_tokens=made.hit_tokens,
        ttl_seconds=made.seconds,
    )


def reservation_stats_to_pb(reservations: Reservations) -> pb.ReservationStats:
    c = reservations.counters
    return pb.ReservationStats(
        live=len(reservations.live),
        made=c.made,
        adopted=c.adopted,
        expired=c.released,
        promised_tokens=c.promised_tokens,
        got_tokens=c.got_tokens,
        short_hits=c.short_hits,
    )
