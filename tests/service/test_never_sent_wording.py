"""Whether a failed call was never sent is read from gRPC's status text
(``kvcoord.client.errors.never_sent``): only an UNAVAILABLE that begins with gRPC's own
words for "no connection could be made" or "the name did not resolve" is. Every other
text must fail safe: a once-only call (DeletePool, Detach, ResetPrefixCache) whose
attempt may have reached the server is not sent again and ends in
OutcomeUnknownError, whatever gRPC or a proxy on the way writes.

What the installed grpcio says (1.85.4; the vLLM venvs have the same), over real
channels: nothing listening, ``failed to connect to all addresses; last error:
UNKNOWN: ipv4:...: Failed to connect to remote host: Connection refused``; no such
unix socket, ``failed to connect to all addresses; last error: FAILED_PRECONDITION:
unix:...``; a name that does not resolve, ``errors resolving <name>: [...]`` (the
native and the c-ares resolvers alike); round_robin instead of pick_first,
``connections to all backends failing; last error: ...`` (not recognised: unknown).
``debug_error_string()`` is ``UNAVAILABLE:`` and the same text, for a status a server
sent as for one gRPC made: no structured mark of where a status came from.

The first test pins the recognised wordings to the installed gRPC (a gRPC that
rewords them makes it fail, while the client stays safe: unknown, never "not sent");
the second the fail-safe direction with the outcomes of applied calls reworded on
the way back by a channel interceptor."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, RetryPolicy, UnavailableError
from kvcoord.client.errors import LocalRpcError, OutcomeUnknownError
from kvcoord.service.testing import InProcessServer
from support import wire_pool_config

#: retries enough to repeat a once-only call if its attempt were taken as never sent
PATIENT = RetryPolicy(initial_backoff=0.001, max_backoff=0.002, deadline=5.0, max_attempts=4)


class Attempts(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Records the status gRPC ended each attempt of ``method`` with (nothing faked)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.seen: list[tuple[grpc.StatusCode, str]] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        if details.method.endswith(self.method):
            try:
                outcome.result()
            except grpc.RpcError as exc:
                self.seen.append((exc.code(), exc.details() or ""))
            else:
                self.seen.append((grpc.StatusCode.OK, ""))
        return outcome


class Reworded(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Lets each ``method`` call reach the server and be answered, then fails it with
    ``code`` and ``text`` instead (an answer lost on the way back, in other words)."""

    def __init__(self, method: str, code: grpc.StatusCode, text: str) -> None:
        self.method, self.code, self.text = method, code, text
        self.applied = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        if not details.method.endswith(self.method):
            return outcome
        outcome.result()  # answered: applied on the server
        self.applied += 1
        return LocalRpcError(self.code, self.text)


def test_the_installed_grpcs_no_connection_and_no_such_name_read_as_never_sent(tmp_path: Any) -> None:
    """A once-only call that gRPC could not send is a known outcome (UnavailableError,
    not OutcomeUnknownError) and is tried again (it applied nothing)."""
    for target in ("127.0.0.1:1", f"unix:{tmp_path}/nobody.sock", "no-such-host.invalid:50051"):
        seen = Attempts("DeletePool")
        with KVCoordClient(target, timeout=5, retry=PATIENT, interceptors=[seen]) as c:
            with pytest.raises(UnavailableError) as failed:
                c.delete_pool("p")
        assert not isinstance(failed.value, OutcomeUnknownError), (target, failed.value)
        assert len(seen.seen) == PATIENT.max_attempts, (target, seen.seen)  # tried again each time
        assert {code for code, _ in seen.seen} == {grpc.StatusCode.UNAVAILABLE}, seen.seen


@pytest.mark.parametrize(
    ("code", "text"),
    [
        # gRPC's connect failure under round_robin (grpcio 1.85.4), and as a later gRPC
        # could word pick_first's: not recognised
        (
            grpc.StatusCode.UNAVAILABLE,
            "connections to all backends failing; last error: UNKNOWN: ipv4:127.0.0.1:2: "
            "Failed to connect to remote host: Connection refused",
        ),
        (grpc.StatusCode.UNAVAILABLE, "Failed to connect to remote host: Connection refused"),
        (grpc.StatusCode.UNAVAILABLE, "FAILED TO CONNECT TO ALL ADDRESSES"),
        # gRPC's words relayed inside another message (a proxy's), or no words at all
        (grpc.StatusCode.UNAVAILABLE, "upstream reset: failed to connect to all addresses"),
        (grpc.StatusCode.UNAVAILABLE, ""),
        # a connection broken after the send (grpcio's words)
        (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
        # gRPC's connect words under another code that leaves the outcome unknown
        (grpc.StatusCode.DEADLINE_EXCEEDED, "failed to connect to all addresses; last error: ..."),
        (grpc.StatusCode.CANCELLED, "errors resolving kvcoord:50051: [...]"),
    ],
)
def test_an_applied_once_only_call_ending_in_any_other_wording_is_an_unknown_outcome(
    server: InProcessServer, client: KVCoordClient, code: grpc.StatusCode, text: str
) -> None:
    client.create_pool("gone", wire_pool_config(8))
    reworded = Reworded("DeletePool", code, text)
    seen = Attempts("DeletePool")
    with KVCoordClient(server.address, timeout=10, retry=PATIENT, interceptors=[seen, reworded]) as c:
        with pytest.raises(OutcomeUnknownError) as unknown:
            c.delete_pool("gone")
    assert unknown.value.code == code
    assert reworded.applied == 1 and len(seen.seen) == 1, seen.seen  # sent once, never again
    assert "gone" not in {p.name for p in client.list_pools().pools}  # (it was applied)
