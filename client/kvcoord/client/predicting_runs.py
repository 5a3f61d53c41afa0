"""A running request's allocation in a predicted session: its sync and its allocation in
one engine call, gathered as an entry of the Step's run (most of a scheduler step's
calls: a decode step inside its blocks is the tracker's next token, the engine's check
of it and the run's entry). :class:`~.predicting.PredictingKVCacheManager` is built on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .items import Admission
from .mirror import UINT32_MAX, Mirror
from .sender import StepSender
from .session import SessionKeeper
from .tracking import RequestTracker

__all__ = ["NOT_TAKEN", "PredictedRuns"]

#: what :meth:`PredictedRuns.allocate_running` answers for a call it does not take
NOT_TAKEN = object()


class PredictedRuns:
    """A running request's ``allocate_slots`` (methods of a PredictingKVCacheManager)."""

    keeper: SessionKeeper
    sender: StepSender
    tracker: RequestTracker
    mirror: Mirror
    #: vLLM 0.33's admission inputs of the allocation being made (SessionFacts')
    admission: Admission
    #: the token count of the request :meth:`allocate_running` last took a call of (its
    #: list's length: what vLLM's ``num_tokens`` property gives), for vLLM's adapter
    running_tokens = 0

    def allocate_running(self, request: Any, num_new_tokens: int, num_lookahead_tokens: int = 0) -> object:
        """``allocate_slots`` of a request the server holds, with only new and look-ahead
        tokens (a running request's step): its sync and allocation in one engine call,
        gathered as an entry of the Step's run. The new block ids per group (the engine's
        tuples: not to be changed), ``None`` (too few free blocks), or ``NOT_TAKEN``,
        nothing changed (an unregistered request, a failure or lease, other counts)."""
        keeper, sender = self.keeper, self.sender
        if (
            sender.failure is not None or keeper.lost is not None or keeper.clock() >= keeper.valid_until
            or type(num_new_tokens) is not int or num_new_tokens <= 0
            or type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0
            or any(self.admission)
        ):  # fmt: skip
            return NOT_TAKEN
        tracker = self.tracker
        rid = request.request_id
        tokens: Sequence[int]
        hashes: Sequence[bytes]
        step = tracker.next_token(request)
        checked = False
        if step is not None:  # a decode step, above all one inside its blocks: no sync made, one engine check
            base_t, base_h, token, computed, was, block_hash = step
            if type(token) is int and token <= UINT32_MAX:  # (else grow names it)
                mirror = self.mirror
                self.running_tokens = base_t + 1
                if block_hash is None:
                    new = mirror.decode_token(rid, computed, token, num_new_tokens, num_lookahead_tokens)
                    if new is not None:
                        sender.add_decode(rid, base_t, base_h, token, computed, num_new_tokens, num_lookahead_tokens, new)  # fmt: skip
                        return new
                # a block to take or to cache: one engine call too (grow, if it is not
                # taken, does not check the inside path again)
                checked = True
                new = mirror.decode_step(rid, computed, token, block_hash, num_new_tokens, num_lookahead_tokens)  # fmt: skip
                if new is not None:
                    sender.add_step(rid, base_t, base_h, token, block_hash, computed, num_new_tokens, num_lookahead_tokens, new)  # fmt: skip
                    return new
            mark, tokens = (base_t, base_h, was, True), (token,)  # (as sync_run gives them)
            hashes = () if block_hash is None else (block_hash,)
        else:
            fields = tracker.sync_run(request)
            if fields is None:
                return NOT_TAKEN
            mark, base_t, base_h, tokens, hashes, computed = fields
        self.running_tokens = base_t + len(tokens)
        try:
            new = self.mirror.grow(
                rid, computed, tokens, hashes, num_new_tokens, num_lookahead_tokens, checked
            )
        except BaseException:
            tracker.restore({rid: mark})
            raise
        if new is None:
            sender.refuse(rid, base_t, base_h, tokens, hashes, computed, num_new_tokens, num_lookahead_tokens)
            return None
        sender.add_to_run(
            rid, base_t, base_h, tokens, hashes, computed, num_new_tokens, num_lookahead_tokens, new
        )
        return new
