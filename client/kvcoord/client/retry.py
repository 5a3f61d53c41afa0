"""Retry settings: jittered exponential backoff under an overall deadline.

A :class:`RetryPolicy` is a frozen value: copy it with ``dataclasses.replace`` to adjust.
Only transient codes are retried, and only for calls that are safe to repeat
(read-only, naturally idempotent, or carrying an idempotency key). An unkeyed mutation
("once": Detach, DeletePool, ResetPrefixCache) is repeated only while its attempts were
never sent: gRPC fails a call at once, before writing any byte of it, while its channel
cannot connect ("failed to connect to all addresses": a server not listening yet, or
restarting), so such an attempt applied nothing; nor did one a server refused as meant
for another replica (WRONG_REPLICA: it reads nothing of such a call). Any other failure
of it (an answer lost, a deadline, a connection broken mid-call) may have been applied
and ends the call.

With ``keyed_deadline`` set (:data:`DEFAULT_RETRY`: 90 s), keyed calls (Allocate,
Free, Step, a reserving ScorePools: applied at most once) are retried that long whatever ``max_attempts``
says, capped by half the server's idempotency window (the client's
``retry_horizon``, from Attach): a call in flight while its server restarts (a kill
and a journaled recovery taking up to a minute) is answered from the journal instead
of ending in OutcomeUnknownError, and a server that keeps answers for 300 s is never
retried past them. Other calls keep ``deadline`` and ``max_attempts`` (a session
renewal must fail in time for its lease to be counted honestly). A policy of one
attempt never retries.

While a replica set changes hands (a pool's owner died and another takes it over, or
a pool is being handed over) the client knows it is waiting on the set, not on a
failing server: it then asks again after short pauses (growing to ``settle_backoff``,
0.25 s) instead of the growing backoff, so the first attempt after the takeover comes
soon; those pauses use no attempt, and end by a keyed call's deadline, or for any
other call once its backoffs could have lasted (about 5 s by default). An
attempt whose outcome was unknown (a keyed call in flight when its owner died) makes
the call end in :class:`~kvcoord.client.errors.OutcomeUnknownError` when the last
attempt's answer is only a redirect or another transient failure; an attempt that was
never sent (no connection could be made), or refused WRONG_REPLICA, is not one of them.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from typing import NoReturn

import grpc

from .errors import (
    KVCoordError,
    NotOwnerError,
    OutcomeUnknownError,
    ResourceExhaustedError,
    UnavailableError,
    answer_over_limit,
    never_sent,
)

__all__ = ["DEFAULT_RETRY", "NO_RETRY", "Attempts", "RetryPolicy"]

#: Codes after which a call may or may not have reached the server (CANCELLED: the
#: client cancels none of its calls; a server stopping mid-call or a proxy did).
UNKNOWN_OUTCOME = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    #: total time for all attempts of one call, in seconds
    deadline: float = 30.0
    max_attempts: int = 8
    retry_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})
    #: total time for the attempts of a keyed call (see the module docstring); None:
    #: as any other call
    keyed_deadline: float | None = None
    #: the longest pause while the replica set changes hands (see the module docstring)
    settle_backoff: float = 0.25

    def retries_keyed_longer(self) -> bool:
        """True when keyed calls follow ``keyed_deadline`` instead of the attempts cap."""
        return (
            self.max_attempts > 1 and self.keyed_deadline is not None and self.keyed_deadline > self.deadline
        )

    def _ceilings(self, count: int) -> Iterator[float]:
        """The longest sleep before each of ``count`` retries (growing to ``max_backoff``)."""
        ceiling = self.initial_backoff
        for _ in range(count):
            yield ceiling
            ceiling = min(ceiling * self.multiplier, self.max_backoff)

    def backoffs(self, rnd: random.Random | None = None, count: int | None = None) -> list[float]:
        """Sleep before each retry (full jitter): ``count`` of them, by default
        ``max_attempts - 1``."""
        r = rnd or random.Random()
        return [r.uniform(0, c) for c in self._ceilings(self.max_attempts - 1 if count is None else count)]

    def longest_wait(self) -> float:
        """The most the ``max_attempts - 1`` backoffs can add up to (each at its ceiling)."""
        return sum(self._ceilings(self.max_attempts - 1), 0.0)

    def settle_pause(self, n: int, rnd: random.Random | None = None) -> float:
        """The ``n``-th pause (from 0) while the replica set changes hands: the backoff
        without its growth past ``settle_backoff``, jittered between half and all of it."""
        ceiling = min(self.initial_backoff * self.multiplier ** min(n, 30), self.settle_backoff)
        return (rnd or random).uniform(ceiling / 2, ceiling)


class Attempts:
    """Decides, after each failed attempt of one call, whether to try again.

    Read-only and keyed calls are retried after a transient failure (a keyed call
    with the same idempotency key, so it is applied at most once; an Attach, whatever
    ended it without telling whether it was applied (UNAVAILABLE, DEADLINE_EXCEEDED,
    CANCELLED), with the same attach_key: the server answers it with the session the
    first made, which it journals with that key, so a restart keeps it) until the policy's
    attempts or deadline run out, and never past ``horizon`` (half the server's
    idempotency window: a retry must reach the server while it still keeps the
    answer). A once-only call is retried only while no attempt was sent (see the
    module docstring). A keyed or once-only call whose outcome is still unknown then
    raises :class:`OutcomeUnknownError`: the caller must treat it as possibly applied.

    Args:
        policy: the retry settings.
        kind: the call's kind (``_requests.RPCS``: read, keyed, attach, once).
        horizon: seconds a keyed call may be retried (half the idempotency window).
    """

    def __init__(self, policy: RetryPolicy, kind: str, horizon: float) -> None:
        self.policy = policy
        self.kind = kind
        self.start = time.monotonic()
        self.keyed_longer = kind == "keyed" and policy.retries_keyed_longer()
        longest = policy.keyed_deadline if self.keyed_longer and policy.keyed_deadline else policy.deadline
        self.deadline = min(longest, horizon)
        #: drawn at the first failure (seeding a generator costs ~10 us, every call)
        self.backoffs: list[float] | None = None
        self.attempt = 0
        #: pauses taken while the replica set changed hands, and until when they may go
        #: on: a keyed call's deadline; any other call no longer than its backoffs could
        #: have lasted (a session renewal must still fail in time)
        self.settles = 0
        self.settle_until = self.start + (
            self.deadline if self.keyed_longer else min(self.deadline, policy.longest_wait())
        )
        #: an attempt ended without telling whether it was applied
        self.unknown = False

    def note(self, err: KVCoordError) -> None:
        """An attempt failed with ``err``: remember whether its outcome is unknown. An
        attempt that was never sent (no connection, a name that did not resolve:
        :func:`~kvcoord.client.errors.never_sent`) applied nothing: its outcome is known.
        One whose answer was over this client's ``max_message_bytes`` was applied
        (:func:`~kvcoord.client.errors.answer_over_limit`): not retried (its answer would
        be as large again), it ends in OutcomeUnknownError."""
        if type(err) is UnavailableError and err.code in UNKNOWN_OUTCOME and not never_sent(err):
            self.unknown = True
        elif answer_over_limit(err):
            self.unknown = True

    def settling(self, err: KVCoordError) -> bool:
        """``err`` is a redirect still left after MAX_HOPS: the replicas disagree on
        the owner for a moment (a claim changing hands, a view not yet re-read). A
        NOT_OWNER answer applied nothing, so a call that may be repeated anyway (a
        read, a keyed call, an Attach) waits and starts over; an unkeyed mutation
        ("once") still raises it."""
        return isinstance(err, NotOwnerError) and self.kind in ("read", "keyed", "attach")

    def next_sleep(self, err: KVCoordError, changing: bool = False) -> float:
        """Seconds to sleep before the next attempt; raises the final error instead.

        ``changing``: the routes say the replica set is changing hands for this pool
        (its owner named by a redirect is down, or the replica called is taking it
        over): a short pause (:meth:`RetryPolicy.settle_pause`) that uses no attempt,
        for any call but an unkeyed mutation, within ``settle_until``."""
        self.note(err)
        if changing and self.kind != "once" and self.policy.max_attempts > 1:
            pause = self.policy.settle_pause(self.settles)
            if time.monotonic() + pause < self.settle_until:
                self.settles += 1
                return pause
            self.fail(err)
        if self.kind == "once":
            # an unkeyed mutation is repeated only when no attempt can have reached a
            # server: this one was never sent (no connection: gRPC fails a call at once,
            # before writing a byte, while its channel cannot connect), nor any before it
            retryable = err.code in self.policy.retry_codes and never_sent(err) and not self.unknown
        else:
            retryable = (
                err.code in self.policy.retry_codes
                or (self.kind in ("keyed", "attach") and err.code in UNKNOWN_OUTCOME)
                or self.settling(err)
            )
        if self.backoffs is None:
            count = None
            if self.keyed_longer:  # enough sleeps to reach the deadline, the deadline decides
                count = max(
                    self.policy.max_attempts - 1, int(self.deadline / max(self.policy.initial_backoff, 0.01))
                )
            self.backoffs = self.policy.backoffs(count=count)
        if (
            retryable
            and self.attempt < len(self.backoffs)
            and time.monotonic() - self.start + self.backoffs[self.attempt] < self.deadline
        ):
            self.attempt += 1
            return self.backoffs[self.attempt - 1]
        self.fail(err)

    def fail(self, err: KVCoordError) -> NoReturn:
        """Raise the call's final error: ``err``, or OutcomeUnknownError when a keyed
        or once-only call had an attempt of unknown outcome and ``err`` does not
        settle it (a transient failure, or a NOT_OWNER / OWNER_CHANGING answer, which
        does not tell whether that attempt was applied; or RESOURCE_EXHAUSTED, e.g. a
        full idempotency budget refusing the retry before its key is kept: the earlier
        attempt, held back on the way, may still arrive and be applied). Any other
        typed answer (a fence, an expired session, a refusal kept under the key) is
        raised as it is: it holds whatever happened."""
        if (
            self.kind in ("keyed", "once")
            and self.unknown
            and isinstance(err, (UnavailableError, NotOwnerError, ResourceExhaustedError))
        ):
            hint = (
                " (its answer was larger than this client's max_message_bytes: set it to the server's)"
                if answer_over_limit(err)
                else ""
            )
            raise OutcomeUnknownError(
                err.code,
                f"the outcome of this call is unknown after {self.attempt + self.settles + 1} attempt(s): "
                f"{err.message}{hint}",
            ) from err
        raise err


#: keyed calls outlast a server restart of a minute; others give up after ~4 s
DEFAULT_RETRY = RetryPolicy(keyed_deadline=90.0)
NO_RETRY = RetryPolicy(max_attempts=1)
