"""Retry settings: jittered exponential backoff under an overall deadline.

A :class:`RetryPolicy` is a frozen value: copy it with ``dataclasses.replace`` to adjust.
Only transient codes are retried, and only for calls that are safe to repeat
(read-only, naturally idempotent, or carrying an idempotency key).
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

    def backoffs(self, rnd: random.Random | None = None) -> list[float]:
        """Sleep before each retry (full jitter), at most ``max_attempts - 1`` of them."""
        r = rnd or random.Random()
        out = []
        ceiling = self.initial_backoff
        for _ in range(self.max_attempts - 1):
            out.append(r.uniform(0, ceiling))
            ceiling = min(ceiling * self.multiplier, self.max_backoff)
        return out


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)
