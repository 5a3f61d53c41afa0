"""A Detach (an unkeyed mutation, "once": never retried when it may have been applied)
that could not be sent is retried; one that may have reached the server is not.

The chaos run's workers met ``UnavailableError: failed to connect to all addresses ...
Connection refused`` from the Detach ``SessionKeeper.start_again`` sends before it
attaches again, while the server was down between two restarts. gRPC fails a call at
once, without writing a byte of it, while its channel cannot connect (gRPC's
wait-for-ready semantics: a call that is not wait-for-ready fails when the channel is in
TRANSIENT_FAILURE); such an attempt applied nothing, so sending it again cannot end a
session twice. Here, over real gRPC and a real ``kvcoord serve``:

* the server is SIGKILLed while a session holds a request; the Detach finds nothing
  listening (connection refused), the server is started again on the same port after
  that first attempt failed, and the Detach is retried until it is answered: the
  session is ended, its request freed (old code: UnavailableError after one attempt);
* a Detach applied by the server whose answer is lost on the way back (a channel
  interceptor drops it: UNAVAILABLE, as a connection broken after the send) is still
  not retried: OutcomeUnknownError after exactly one attempt, the session ended once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from durable_server import attach, leased_server, step_allocate
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import OutcomeUnknownError
from kvcoord.client.faults import FaultInjector
from kvcoord.client.retry import RetryPolicy
from support import held_blocks

#: enough attempts to outlast gRPC's reconnect backoff (1 s, then 1.6 s, ...) while the
#: server starts again: bounded by the deadline
PATIENT = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=60.0, max_attempts=200)


class DetachAttempts(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Records how each Detach attempt ended (gRPC's own status: nothing is faked) and
    runs ``after_first_failure`` once, after the first attempt that failed."""

    def __init__(self, after_first_failure: Any) -> None:
        self.after_first_failure = after_first_failure
        self.seen: list[tuple[grpc.StatusCode, str]] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not details.method.endswith("/Detach"):
            return continuation(details, request)
        try:
            outcome = continuation(details, request)
            outcome.result()
        except grpc.RpcError as exc:  # (raised by an inner interceptor, or gRPC's outcome)
            self.seen.append((exc.code(), exc.details() or ""))
            if self.after_first_failure is not None:
                start, self.after_first_failure = self.after_first_failure, None
                start()
            raise
        self.seen.append((grpc.StatusCode.OK, ""))
        return outcome


def test_a_detach_never_sent_is_retried_and_one_whose_answer_was_lost_is_not(tmp_path: Path) -> None:
    server = leased_server(tmp_path, 30.0, 64)
    server.start()
    try:
        with KVCoordClient(server.address, timeout=10) as admin:
            worker = attach(admin, "w", 30.0)
            held = step_allocate(admin, worker, "r1", 16)
            assert held_blocks(admin, "p") == {"r1": held}

            # 1. nothing listens: the Detach fails to connect, the server comes back
            server.kill()
            attempts = DetachAttempts(server.start)
            with KVCoordClient(server.address, timeout=10, retry=PATIENT, interceptors=[attempts]) as c:
                c.detach(worker.session_id, worker.fence)
            assert attempts.seen[-1][0] == grpc.StatusCode.OK, attempts.seen
            refused = attempts.seen[:-1]
            assert refused, attempts.seen  # (the first attempt found nothing listening)
            for code, message in refused:  # every attempt retried was one gRPC never sent
                assert code == grpc.StatusCode.UNAVAILABLE, attempts.seen
                assert message.startswith("failed to connect to all addresses"), attempts.seen
            assert worker.session_id not in {s.session_id for s in admin.list_sessions("p").sessions}
            assert held_blocks(admin, "p") == {}  # ended once: its request freed
            assert not admin.check_pool("p").violations

            # 2. applied, its answer lost: not retried, a typed unknown outcome
            other = attach(admin, "o", 30.0)
            step_allocate(admin, other, "r2", 16)
            lose = FaultInjector(0, drop=1.0, methods=("Detach",))
            seen = DetachAttempts(None)
            with KVCoordClient(server.address, timeout=10, retry=PATIENT, interceptors=[seen, lose]) as c:
                try:
                    c.detach(other.session_id, other.fence)
                except OutcomeUnknownError:
                    pass
                else:
                    raise AssertionError("a Detach whose answer was lost was answered")
            assert lose.counts["dropped"] == 1
            assert len(seen.seen) == 1, seen.seen  # sent once, never again
            assert other.session_id not in {s.session_id for s in admin.list_sessions("p").sessions}
            assert held_blocks(admin, "p") == {}
            assert not admin.check_pool("p").violations
    finally:
        server.stop()
