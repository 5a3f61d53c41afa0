"""DecodeOp: a decode step's allocations in columns, applied by one loop.

Each entry is answered, and leaves the pool, exactly as its AllocateOp would in the
same Step (the proto's DecodeOp). An entry of this session's request at its position
with tokens to append, while no reservation is live, takes the engine's fused
update-and-allocate (what ``PoolService._allocate_plain`` does for a plain AllocateOp);
any other entry is built into its AllocateOp and applied by the pool's own Allocate
handler, which says what is wrong with it. The first entry that fails fails the
operation with its own error (:class:`~.operations.DecodeFailed`, carrying the entries
before it, which stay applied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcoord.engine import RequestCheckpoint

from . import operations as op
from .errors import ServiceError, Status, as_service_error

if TYPE_CHECKING:
    from .pool_service import PoolService
    from .sessions import Session

__all__ = ["apply_decode"]


def apply_decode(service: PoolService, s: Session, o: op.Decode) -> op.Value:
    """Apply ``o``'s entries in order (see the module docstring).

    Raises:
        ServiceError: INVALID_ARGUMENT (nothing applied) when the columns do not have
            one value per entry or the appended values do not add up;
            :class:`~.operations.DecodeFailed` when an entry fails.
    """
    rids = o.request_ids
    n = len(rids)
    base_t, base_h, computed = o.base_num_tokens, o.base_num_hashes, o.num_computed_tokens
    new_tokens, look, num_t, num_h = (
        o.num_new_tokens,
        o.num_lookahead_tokens,
        o.num_append_tokens,
        o.num_append_hashes,
    )
    if any(len(c) != n for c in (base_t, base_h, computed, new_tokens, look, num_t, num_h)):
        raise ServiceError(Status.INVALID, "decode: every column needs one value per entry")
    tokens, hashes = o.append_token_ids, o.append_block_hashes
    if sum(num_t) != len(tokens) or sum(num_h) != len(hashes):
        raise ServiceError(
            Status.INVALID,
            "decode: num_append_tokens / num_append_hashes do not add up to the appended values",
        )
    engine = service.engine
    must = o.must_succeed
    fused = not engine.reservations.live  # else a first allocation may adopt one: the handler's
    owners, requests = service.owners, engine.requests
    update_and_allocate = engine.update_and_allocate
    refused_groups = [0] * len(engine.managers)
    counts: list[int] = []
    ids: list[int] = []
    refused: list[int] = []
    t = h = 0
    entries = zip(rids, base_t, base_h, computed, new_tokens, look, num_t, num_h, strict=True)
    for i, (rid, bt, bh, c, nn, la, nt, nh) in enumerate(entries):
        tk, hs = tokens[t : t + nt], hashes[h : h + nh]
        t += nt
        h += nh
        try:
            req = requests.get(rid)
            if (
                fused
                and nt
                and req is not None
                and owners.get(rid) is s
                and len(req.all_token_ids) == bt
                and len(req.block_hashes) == bh
            ):
                before = (bt, bh, req.num_computed_tokens)
                new = update_and_allocate(rid, c, tk, hs, nn, la)
                if new is None and must:  # as the Allocate handler: the sync undone, then the error
                    engine.restore_request(rid, RequestCheckpoint(*before))
                    raise service.prediction_failed(rid)
            else:
                sync = op.RequestSync(rid, tk, hs, False, bt, bh, c)
                value = service.allocate_entry(
                    s, op.Allocate(sync, nn, num_lookahead_tokens=la, must_succeed=must)
                )
                assert isinstance(value, op.AllocateOutcome)
                new = value.new_block_ids
        except Exception as exc:  # noqa: BLE001 - every failure is the entry's answer
            raise op.DecodeFailed(as_service_error(exc), op.DecodeOutcome(i, counts, ids, refused)) from exc
        if new is None:
            refused.append(i)
            counts += refused_groups
        else:
            for group in new:
                counts.append(len(group))
                if group:
                    ids += group
    return op.DecodeOutcome(n, counts, ids, refused)
