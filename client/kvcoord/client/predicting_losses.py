"""How a predicted session meets a loss: every request of the session is reported lost
and the session starts again from the server's state; or, when the pool can no longer be
predicted (the new session's server runs another engine, a rolling upgrade, or has no
state to give), the manager ends and :attr:`PredictedLosses.on_unpredictable` (vLLM's
adapter) takes over with a session that waits for the server.
:class:`~.predicting.PredictingKVCacheManager` is built on it."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from .errors import FailedPreconditionError, KVCoordError, RequestsLostError, ResourceExhaustedError
from .mirror import Mirror
from .sender import StepSender
from .session import SessionKeeper
from .session_facts import PoolChangedError

__all__ = ["PoolChangedError", "PredictedLosses", "PredictionUnavailableError"]


class PredictionUnavailableError(FailedPreconditionError):
    """The server gives no state this client can mirror (``why``: no engine state,
    another state version or rules fingerprint, routers' reservations): the pool's
    answers cannot be predicted, so its sessions must wait for the server's
    (``RemoteKVCacheManager``)."""

    def __init__(self, pool: str, why: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, f"pool {pool!r} cannot be predicted: {why}")
        self.why = why


class PredictedLosses:
    """The loss half of a predicted session (methods of a PredictingKVCacheManager)."""

    pool: str
    mirror: Mirror
    sender: StepSender
    keeper: SessionKeeper
    #: called when a lost session, attached again, can no longer be predicted (see
    #: :meth:`_settled`); vLLM's adapter sets it to go on waiting for the server
    on_unpredictable: Callable[[PredictionUnavailableError], None] | None = None
    #: why this manager's prediction ended (its session too), once it did
    ended: PredictionUnavailableError | PoolChangedError | None = None

    def _loaded(self) -> Mirror:
        raise NotImplementedError

    def _settled(self) -> None:
        """Report a failure: every request is lost, and the session starts again from
        the server's state.

        A pool that can no longer be predicted (the session attached again to a server
        restarted with another engine, or one with no state to give) ends this manager:
        its requests are reported lost as for any loss, once :attr:`on_unpredictable`
        made the session that takes over.

        Raises:
            RequestsLostError: naming every request the session held.
            PredictionUnavailableError: the pool can no longer be predicted and nothing
                takes over (no :attr:`on_unpredictable`); the requests lost are reported
                by the call that gets past it.
            PoolChangedError: the pool was created again with another configuration;
                this call and every later one (nothing takes over).
            KVCoordError: the server cannot be reached to start again, or the session
                taking over could not be made (the next call tries again).
        """
        if self.sender.failure is None:
            return
        if self.ended is not None:
            raise self.ended
        try:
            lost = self.sender.recover()
        except PredictionUnavailableError as err:
            raise self._end(err) from None
        except PoolChangedError as err:  # for good: no session, every later call refused
            self.ended = err
            raise
        except ResourceExhaustedError as err:
            if err.reason != "ANSWER_TOO_LARGE":
                raise
            raise self._end(PredictionUnavailableError(self.pool, err.message)) from None
        self.mirror = self._loaded()  # from the new session's state
        raise lost

    def _end(self, err: PredictionUnavailableError) -> KVCoordError:
        """The lost session's new one cannot be predicted (``err``; none is attached):
        hand over to :attr:`on_unpredictable` and return what the call raises, every
        request lost; without it, ``err``."""
        take_over = self.on_unpredictable
        if take_over is None:
            return err
        take_over(err)  # raises (nothing changed here) when it cannot: the next call tries again
        sender = self.sender
        lost, sender.unreported = sender.unreported, []
        failure, sender.failure = sender.failure, err  # (a call made on this manager still refuses)
        assert failure is not None
        sender.lost_requests += len(lost)
        self.ended = err
        sender.close()
        self.keeper.close()
        return RequestsLostError(lost, failure)

    def _vouch(self) -> None:
        """Answer only while the session's lease certainly runs (else another session
        could be given these blocks)."""
        keeper = self.keeper
        if keeper.lost is not None or keeper.clock() >= keeper.valid_until:
            self.sender.settle()  # the answer in flight renews the lease
            try:
                keeper.vouch()
            except KVCoordError as err:
                self.sender.failure = self.sender.failure or err
            self._settled()
