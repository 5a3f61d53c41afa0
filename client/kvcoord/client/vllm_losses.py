"""What vLLM's adapter (:class:`~.vllm_manager.KVCoordKVCacheManager`) does with a
lost session and an outage: the errors the scheduler waits out, the losses kept for it
while it applies a step's outputs, a pool created again on a server that lost it, and a
predicted session that can no longer be predicted mid-run replaced by a waiting one."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .errors import (
    AlreadyExistsError,
    FencedError,
    KVCoordError,
    LeaseExpiredError,
    NotFoundError,
    PoolBusyError,
    RequestsLostError,
    RequestUnknownError,
    SessionExpiredError,
    UnavailableError,
)
from .manager import RemoteKVCacheManager
from .predicting import PredictingKVCacheManager, PredictionUnavailableError

__all__ = ["OUTAGE_ERRORS", "REFUSALS", "AdapterLosses", "absorbing", "is_outage"]

logger = logging.getLogger(__name__)

#: Errors that end no request by themselves: the server cannot be reached (or is in a
#: grace period), a lease cannot be vouched for, a session or the pool is gone from a
#: server that restarted, an exclusive session still holds the pool (one whose Attach
#: answer was lost, until its lease ends). The managers turn what they cost into
#: RequestsLostError when they can attach again; until then the scheduler waits and
#: tries again. ``NotFoundError`` is here for a pool gone from the server, but not every
#: NotFoundError is an outage: see :data:`REFUSALS` and :func:`is_outage`, which the
#: adapter and the scheduler decide by (this tuple is what they catch).
OUTAGE_ERRORS = (
    UnavailableError, LeaseExpiredError, FencedError, SessionExpiredError, NotFoundError, PoolBusyError,
)  # fmt: skip

#: Refusals among :data:`OUTAGE_ERRORS`' classes that no wait changes: a request the
#: pool does not hold (REQUEST_UNKNOWN, from the server or a predicted session's mirror).
#: The server checks a call's fence and session before its requests (a restart, a lease
#: that ran out, a pool re-created or handed over answer with their own reasons first)
#: and a live session's requests leave its table only by its own calls; the mirror is
#: changed only by this client's calls. Waited for, it would be undone and made again
#: until ``KVCOORD_MAX_OUTAGE``: it reaches vLLM at once instead. (The waiting mode
#: reports a request whose sync the server refuses so as lost, ``RequestsLostError``:
#: recomputed at once, a loss, not an outage.)
REFUSALS = (RequestUnknownError,)


def is_outage(err: BaseException) -> bool:
    """Whether ``err`` is waited out (an outage), not a refusal that reaches vLLM."""
    return isinstance(err, OUTAGE_ERRORS) and not isinstance(err, REFUSALS)


def absorbing(default: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A manager method that, while the manager is ``absorbing``, keeps a loss or an
    outage for the scheduler (``_absorb``) and answers ``default(self, *args)``."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except KVCoordError as err:
                self._absorb(err)  # (raises it unless absorbing)
                return default(self, *args)

        return call

    return wrap


class AdapterLosses:
    """The loss half of vLLM's adapter (methods of a KVCoordKVCacheManager)."""

    remote: RemoteKVCacheManager | PredictingKVCacheManager
    lost: set[str]
    absorbed: int
    absorbing: bool
    pool_to_create: Any
    _allocate_running: Any
    #: why the session stopped being predicted mid-run (see :meth:`go_on_waiting_with`)
    unpredicted: str | None = None

    def _absorb(self, err: KVCoordError) -> None:
        """Keep what ``err`` says for the scheduler while ``absorbing``; else, or for a
        refusal no wait changes (:data:`REFUSALS`), raise it (the one place of the rule)."""
        if not self.absorbing:
            raise err
        if isinstance(err, RequestsLostError):
            self.lost.update(err.request_ids)
        elif not is_outage(err):
            raise err
        self.absorbed += 1
        logger.warning("kvcoord pool %r: %s (handled at the next schedule)", self.remote.pool, err)

    def go_on_waiting_with(self, make_waiting: Callable[[], RemoteKVCacheManager]) -> None:
        """When the predicted session's pool can no longer be predicted mid-run (a lost
        session attached again to a server restarted with another engine, a rolling
        upgrade; or to one with no state to give), ``make_waiting()`` takes over: a
        session that waits for the server's every answer, as :func:`connect` runs one
        from the start. The predicted session's requests are reported lost (the
        scheduler preempts and recomputes them) and nothing it answered is kept."""
        remote = self.remote
        if isinstance(remote, PredictingKVCacheManager):
            remote.on_unpredictable = functools.partial(self._wait_from_now, make_waiting)

    def _wait_from_now(
        self, make_waiting: Callable[[], RemoteKVCacheManager], err: PredictionUnavailableError
    ) -> None:
        """The waiting session takes over from the predicted one (see :meth:`go_on_waiting_with`).

        Raises:
            KVCoordError: it could not be made (nothing changed: the predicted session
                tries to attach again at its next call).
        """
        predicted = self.remote
        waiting = make_waiting()
        # the engine's count of requests lost goes on (those this loss reports included),
        # and a lost request used again before the scheduler preempted it is refused as
        # by the predicted session (never registered afresh beside its lost table)
        waiting.sender.lost_requests += predicted.lost_requests + len(predicted.sender.unreported)
        waiting.tracker.lost.update(predicted.tracker.lost)
        self.remote = waiting
        self._allocate_running = None
        self._took_over(waiting)
        self.unpredicted = err.why
        logger.warning(
            "KVCOORD_PREDICT: pool %r can no longer be predicted (%s); its requests are lost (recomputed) and "
            "the engine runs the waiting mode from now on: every call is answered by the server, as on a "
            "shared pool", waiting.pool, err.why,
        )  # fmt: skip

    def _took_over(self, remote: RemoteKVCacheManager) -> None:
        """``remote`` replaced the session (for what holds it besides ``remote``)."""

    def take_lost(self) -> set[str]:
        """The requests reported lost while absorbing, since the last call."""
        lost, self.lost = self.lost, set()
        return lost

    def create_pool_again(self) -> bool:
        """Create the pool (as connect did) on a server that no longer has it; False when
        this manager was not told how (KVCOORD_CREATE_POOL=0)."""
        if self.pool_to_create is None:
            return False
        name, config = self.pool_to_create
        try:
            self.remote.client.create_pool(name, config)
        except AlreadyExistsError:
            pass  # made meanwhile (by another engine, or the call's own retry)
        logger.warning("kvcoord pool %r was gone from the server: created again", name)
        return True
