"""A DeletePool retried after its answer was lost never deletes the pool made again since.

DeletePool named the pool by its name only. Its answer lost (the call applied), the
client raises OutcomeUnknownError (it is sent once: it never retries it itself) and
its caller deletes again, as an unknown outcome asks; if the pool was made again
meanwhile (another operator, a deployment re-creating it), that retry deleted the new
pool, its sessions and requests. DeletePoolRequest.incarnation (the one CreatePool or
GetPool told) now names the incarnation to delete: another one is refused
FAILED_PRECONDITION (INCARNATION_CHANGED) and nothing is deleted. Over real gRPC, the
answer dropped in a channel interceptor (the pool made again before its caller hears
of the loss).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from helpers import allocate
from kvcoord.client import KVCoordClient, NotFoundError, OutcomeUnknownError
from kvcoord.client.errors import FencedError
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer


def _lost_delete_then_made_again(
    server: InProcessServer,
) -> tuple[KVCoordClient, KVCoordClient, int, int, str]:
    """The operator's DeletePool of pool p (incarnation ``old``) is applied, its answer
    lost; before the operator hears of it, p is created again (``new``) and a worker
    attaches and allocates ``w1`` in it. Returns the operator's and the worker's client,
    both incarnations and the worker's session id."""
    drop = FaultInjector(0, drop=1.0, methods=("DeletePool",))
    operator = KVCoordClient(server.address, timeout=10, interceptors=[drop])
    worker = KVCoordClient(server.address, timeout=10)
    info = worker.get_pool("p").pool
    old = info.fence.incarnation
    made: list[int] = []

    def make_again() -> None:
        made.append(worker.create_pool("p", info.config).pool.fence.incarnation)

    drop.on_drop = make_again
    with pytest.raises(OutcomeUnknownError):
        operator.delete_pool("p", incarnation=old)
    assert drop.counts["dropped"] == 1 and made and made[0] != old
    s = worker.attach("p", "sha256_cbor", 4, "0", "worker")
    step = worker.step("p", [allocate("w1", list(range(16)), 16)], s.session_id, s.fence)
    assert step.results[0].status_code == 0
    drop.enabled = False
    return operator, worker, old, made[0], s.session_id


def test_a_retried_delete_naming_the_old_incarnation_leaves_the_new_pool(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The operator deletes again, naming the incarnation it meant: refused
    FAILED_PRECONDITION (INCARNATION_CHANGED), naming both incarnations; the new pool,
    the worker's session and its request stand. (Without the incarnation the retry
    deletes the new pool: the next test.)"""
    server = make_server()
    operator, worker, old, new, session_id = _lost_delete_then_made_again(server)
    with operator, worker:
        with pytest.raises(FencedError) as refused:
            operator.delete_pool("p", incarnation=old)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.reason == "INCARNATION_CHANGED"
        assert str(old) in str(refused.value) and str(new) in str(refused.value)
        assert worker.get_pool("p").pool.fence.incarnation == new
        assert [r.request_id for r in worker.inspect_pool("p", all_requests=True).requests] == ["w1"]
        assert [s.session_id for s in worker.list_sessions("p").sessions] == [session_id]
        operator.delete_pool("p", incarnation=new)  # the incarnation it is now: deleted
        with pytest.raises(NotFoundError):
            worker.get_pool("p")


def test_a_delete_naming_no_incarnation_deletes_whichever_is_there(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Pins what a caller naming no incarnation gets (0: whichever the pool is now):
    the retry deletes the pool made again, as before."""
    server = make_server()
    operator, worker, _, _, _ = _lost_delete_then_made_again(server)
    with operator, worker:
        operator.delete_pool("p")
        with pytest.raises(NotFoundError):
            worker.get_pool("p")
