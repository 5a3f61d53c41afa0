"""Retry settings: jittered exponential backoff under an overall deadline.

A :class:`RetryPolicy` is a frozen value: copy it with ``dataclasses.replace`` to adjust.
Only transient codes are retried, and only for calls that are safe to repeat
(read-only, naturally idempotent, or carrying an idempotency key).

With ``keyed_deadline`` set (:data:`DEFAULT_RETRY`: 90 s), keyed calls (Allocate,
Free, Step: applied at most once) are retried that long whatever ``max_attempts``
says, capped by half the server's idempotency window (the client's
``retry_horizon``, from Attach): a call in flight while its server restarts (a kill
and a journaled recovery taking up to a minute) is answered from the journal instead
of ending in OutcomeUnknownError, and a server that keeps answers for 300 s is never
retried past them. Other calls keep ``deadline`` and ``max_attempts`` (a session
renewal must fail in time for its lease to be counted honestly). A policy of one
attempt never retries.
"""

from __future__ import annotations

import dataclasses
import random

import grpc

__all__ = ["DEFAULT_RETRY", "NO_RETRY", "RetryPolicy"]


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

    def retries_keyed_longer(self) -> bool:
        """True when keyed calls follow ``keyed_deadline`` instead of the attempts cap."""
        return (
            self.max_attempts > 1 and self.keyed_deadline is not None and self.keyed_deadline > self.deadline
        )

    def backoffs(self, rnd: random.Random | None = None, count: int | None = None) -> list[float]:
        """Sleep before each retry (full jitter): ``count`` of them, by default
        ``max_attempts - 1``."""
        r = rnd or random.Random()
        out = []
        ceiling = self.initial_backoff
        for _ in range(self.max_attempts - 1 if count is None else count):
            out.append(r.uniform(0, ceiling))
            ceiling = min(ceiling * self.multiplier, self.max_backoff)
        return out


#: keyed calls outlast a server restart of a minute; others give up after ~4 s
DEFAULT_RETRY = RetryPolicy(keyed_deadline=90.0)
NO_RETRY = RetryPolicy(max_attempts=1)
