"""An exclusive session's mirror refuses a call with the error the server answers for
the same call over gRPC: the same client type and the same reason.

The scheduler acts on the type: a plain ``NotFoundError`` says the pool is gone from
the server (vLLM's scheduler creates it again), a ``RequestUnknownError`` that a
request is not in it. A mirror that answered a request it does not hold with a plain
``NotFoundError`` made the scheduler create the pool again and again, without a
pause, until ``KVCOORD_MAX_OUTAGE``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kvcoord import engine
from kvcoord.client import KVCoordClient
from kvcoord.client.answers import op_error
from kvcoord.client.errors import KVCoordError, RequestUnknownError
from kvcoord.client.mirror import Mirror
from kvcoord.client.tracking import SyncValues
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import follow_up
from service.test_partial_hits_wire import pool as pool_033


def _mirror(
    client: KVCoordClient, pool: str, profile: str = ""
) -> tuple[Mirror, Callable[[pb.Operation], Any]]:
    """An exclusive session's mirror of ``pool``, and a one-operation Step on the
    same session (its result's typed error, or ``None``)."""
    att = client.attach(pool, "sha256_cbor", 4 if not profile else 16, "0", exclusive=True, want_pool_state=True,
                        want_engine_state=True, profile=profile)  # fmt: skip
    mirror = Mirror(client.get_pool(pool).pool.config, att.pool_state)

    def step(o: pb.Operation) -> KVCoordError | None:
        (r,) = client.step(pool, [o], att.session_id, att.fence).results
        return op_error(r) if r.status_code else None

    return mirror, step


def _refused(call: Callable[[], Any]) -> KVCoordError:
    with pytest.raises(KVCoordError) as info:
        call()
    return info.value


def test_every_engine_reason_is_a_reason_of_the_wire() -> None:
    """The server answers an engine error with its own reason (``ErrorReason[...]``)."""
    reasons = {
        c.reason
        for c in vars(engine.errors).values()
        if isinstance(c, type) and issubclass(c, engine.EngineError)
    }
    assert reasons >= {"", "REQUEST_UNKNOWN", "BLOCK_NOT_RETAINED"}
    for name in reasons - {""}:
        pb.ErrorReason.Value(name)  # (raises for an unknown name)


def test_a_request_the_pool_does_not_hold_is_refused_as_the_server_refuses_it(client: KVCoordClient) -> None:
    mirror, step = _mirror(client, "p")
    cases = [
        (lambda: mirror.allocate("ghost", 4), pb.Operation(allocate=pb.AllocateOp(request=follow_up("ghost", ()), num_new_tokens=4))),
        (lambda: mirror.call("get_num_common_prefix_blocks", "ghost"), pb.Operation(common_prefix=pb.CommonPrefixOp(request_id="ghost"))),
        (lambda: mirror.apply(SyncValues("ghost", False, 0, 0, computed=4)), pb.Operation(sync=pb.SyncOp(request=follow_up("ghost", (), num_computed_tokens=4)))),
        (lambda: mirror.table("ghost"), pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id="ghost"))),
    ]  # fmt: skip
    for mirrored, sent in cases:
        mine, servers = _refused(mirrored), step(sent)
        assert servers is not None
        assert (
            (type(mine), mine.reason)
            == (type(servers), servers.reason)
            == (RequestUnknownError, "REQUEST_UNKNOWN")
        )


def test_a_block_not_retained_is_refused_as_the_server_refuses_it(client: KVCoordClient) -> None:
    client.create_pool("cow", pool_033())
    mirror, step = _mirror(client, "cow", "vllm-0.33")
    mine = _refused(lambda: mirror.call("release_retained_blocks", [4]))
    servers = step(pb.Operation(release_retained_blocks=pb.ReleaseRetainedBlocksOp(block_ids=[4])))
    assert servers is not None
    assert (type(mine), mine.reason) == (type(servers), servers.reason)
    assert mine.reason == "BLOCK_NOT_RETAINED"
