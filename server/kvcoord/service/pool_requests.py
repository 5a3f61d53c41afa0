"""Which session owns which request of a pool, and positioned request sync: a request
registered, or brought to the client's position, before an operation runs (and undone
when it fails). A part of :class:`~.pool_service.PoolService` (its ``syncs``), used by
its Step operations; the owners table itself is the pool's (``PoolService.owners``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcoord.engine import RequestCheckpoint

from . import operations as op
from .errors import ErrorReason, Position, ServiceError, Status
from .pool_core import PoolCore
from .pool_types import Undo
from .sessions import Session


def noop() -> None:
    """The undo of a sync that changed nothing."""


class RequestSyncs:
    """Request ownership checks and syncs of one pool."""

    def __init__(self, pool: PoolCore) -> None:
        self.pool = pool

    def position(self, rid: str) -> Position:
        req = self.pool.engine.requests.get(rid)
        if req is None:
            return Position(rid, False)
        return Position(rid, True, req.num_tokens, len(req.block_hashes), req.num_computed_tokens)

    def check_owned(self, s: Session, rid: str) -> None:
        """Check that ``rid`` exists and belongs to ``s``."""
        if not rid:
            raise ServiceError(Status.INVALID, "request_id is required")
        owner = self.pool.owners.get(rid)
        if owner is None or owner.tenant != s.tenant:
            # Another tenant's request is answered exactly as an unknown one: no caller
            # learns which request ids another tenant has live.
            raise ServiceError(
                Status.NOT_FOUND,
                f"request {rid[:128]!r} is not in pool {self.pool.name!r} (never registered, or freed)",
                ErrorReason.REQUEST_UNKNOWN,
                self.position(rid) if owner is None else Position(rid, False),
            )
        if owner is not s:
            raise ServiceError(
                Status.DENIED,
                f"request {rid[:128]!r} belongs to another session of pool {self.pool.name!r}",
            )

    def sync(self, s: Session, sync: op.RequestSync) -> Undo:
        """Apply a positioned request sync; returns how to undo it.

        Raises:
            ServiceError: SYNC_MISMATCH / REQUEST_UNKNOWN with the server's position,
                PERMISSION_DENIED, RESOURCE_EXHAUSTED; engine errors for bad values.
        """
        rid = sync.request_id
        engine = self.pool.engine
        if sync.new_request:
            if not rid:
                raise ServiceError(Status.INVALID, "request_id is required")
            if sync.base_num_tokens or sync.base_num_hashes or sync.rewind_num_tokens is not None:
                raise ServiceError(
                    Status.INVALID,
                    f"request {rid[:128]!r}: a new_request sync starts at position 0, got base "
                    f"{sync.base_num_tokens} tokens / {sync.base_num_hashes} hashes"
                    + ("" if sync.rewind_num_tokens is None else " and a rewind"),
                )
            owner = self.pool.owners.get(rid)
            if owner is not None and owner.tenant != s.tenant:
                # Request ids are pool-wide: this one is taken, and saying so is unavoidable
                # (README "Tenants"), but not by whom.
                raise ServiceError(
                    Status.DENIED,
                    f"request id {rid[:128]!r} is in use in pool {self.pool.name!r}; request ids are shared by "
                    "every tenant of a pool: use unique (random) ones",
                )
            if owner is not None and owner is not s:
                raise ServiceError(
                    Status.DENIED,
                    f"request {rid[:128]!r} belongs to another session of pool {self.pool.name!r}",
                )
            if rid in engine.requests:
                raise ServiceError(
                    Status.PRECONDITION,
                    f"request {rid[:128]!r} is already registered in pool {self.pool.name!r}",
                    ErrorReason.SYNC_MISMATCH,
                    self.position(rid),
                )
            if len(engine.requests) >= self.pool.limits.max_requests_per_pool:
                raise ServiceError(
                    Status.EXHAUSTED,
                    f"pool {self.pool.name!r} already tracks {len(engine.requests)} requests (max_requests_per_pool)",
                )
            engine.add_request(
                rid,
                sync.append_token_ids,
                sync.append_block_hashes,
                lora=sync.lora,
                skip_reading_prefix_cache=sync.skip_reading_prefix_cache,
                num_preemptions=sync.num_preemptions or 0,
                cache_namespace=s.cache_namespace,
                cache_salt=sync.cache_salt,
                extra_key_sources=sync.extra_key_sources,
                num_prompt_tokens=sync.num_prompt_tokens,
                kv_cache_report_full=sync.kv_cache_report_full,
            )
            if sync.num_computed_tokens is not None:
                try:
                    engine.update_request(rid, num_computed_tokens=sync.num_computed_tokens)
                except Exception:
                    engine.restore_request(rid, None)
                    raise
            self.pool.owners[rid] = s
            s.owned[rid] = None

            def forget() -> None:
                engine.restore_request(rid, None)
                self.pool.owners.pop(rid, None)
                s.owned.pop(rid, None)

            return forget
        if self.pool.owners.get(rid) is not s:  # (a request id of s is never empty)
            self.check_owned(s, rid)  # raises, saying why
        req = engine.requests[rid]
        if req.num_tokens != sync.base_num_tokens or len(req.block_hashes) != sync.base_num_hashes:
            raise ServiceError(
                Status.PRECONDITION,
                f"request {rid[:128]!r}: the sync applies at {sync.base_num_tokens} tokens / "
                f"{sync.base_num_hashes} hashes, but the server holds {req.num_tokens} / "
                f"{len(req.block_hashes)}; nothing was changed",
                ErrorReason.SYNC_MISMATCH,
                self.position(rid),
            )
        computed = sync.num_computed_tokens
        rewind_to = sync.rewind_num_tokens
        prompt = sync.num_prompt_tokens
        if (
            not sync.append_token_ids
            and not sync.append_block_hashes
            and computed is None
            and rewind_to is None
            and prompt is None
        ):
            return noop
        # engine.checkpoint_request's value, from the record at hand
        checkpoint = RequestCheckpoint(
            req.num_tokens, len(req.block_hashes), req.num_computed_tokens, req.num_prompt_tokens
        )
        if rewind_to is not None:
            return self._rewind(rid, sync)
        engine.update_request(
            rid,
            num_computed_tokens=computed,
            append_token_ids=sync.append_token_ids,
            append_block_hashes=sync.append_block_hashes,
            num_prompt_tokens=prompt,
        )
        return lambda: engine.restore_request(rid, checkpoint)

    def _rewind(self, rid: str, sync: op.RequestSync) -> Undo:
        """:meth:`sync` of a rewinding sync (its position checked): the request cut back
        (the engine's rule, checked against the computed count this sync sets), then
        updated as usual; refused with nothing changed. Returns how to undo it."""
        engine = self.pool.engine
        assert sync.rewind_num_tokens is not None
        if sync.rewind_num_tokens > sync.base_num_tokens:
            raise ServiceError(
                Status.INVALID,
                f"request {rid[:128]!r}: a rewind to {sync.rewind_num_tokens} tokens, past the sync's "
                f"position ({sync.base_num_tokens} tokens)",
            )
        return engine.update_rewound(
            rid,
            sync.rewind_num_tokens,
            sync.num_computed_tokens,
            sync.append_token_ids,
            sync.append_block_hashes,
            sync.num_prompt_tokens,
        )

    def with_sync(self, s: Session, sync: op.RequestSync, call: Callable[[str], op.Value]) -> op.Value:
        undo = self.sync(s, sync)
        try:
            return call(sync.request_id)
        except Exception:
            undo()
            raise

    def owned_prefix(self, s: Session, request_ids: Sequence[str]) -> int:
        """How many of ``request_ids``, from the first, are requests ``s`` holds (all of
        them, in a session's own decode step; one pass in C)."""
        holders = list(map(self.pool.owners.get, request_ids))
        if holders.count(s) == len(holders):
            return len(holders)
        return next(k for k, x in enumerate(holders) if x is not s)
