"""The two clients' RPC methods: one per unary RPC of the service, typed with its
response, with the same parameters in the sync and asyncio clients."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Coroutine

from kvcoord.client import _requests as rq
from kvcoord.client import aio as aio_module
from kvcoord.client import client as client_module
from kvcoord.client.aio import AsyncKVCoordClient
from kvcoord.client.api import UNARY_METHODS
from kvcoord.client.client import KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Allocator"]


def test_every_unary_rpc_has_a_typed_method() -> None:
    """Each unary RPC of the service (the streaming WatchEvents aside) is called by one
    method, whose request and response types are the service's."""
    unary = {m.name for m in SERVICE.methods if not m.server_streaming and not m.client_streaming}
    assert {rpc.name for rpc in UNARY_METHODS.values()} == unary == set(rq.RPCS)
    for rpc in UNARY_METHODS.values():
        method = SERVICE.methods_by_name[rpc.name]
        assert rpc.request.DESCRIPTOR.full_name == method.input_type.full_name, rpc.name
        assert rpc.response.DESCRIPTOR.full_name == method.output_type.full_name, rpc.name


def test_sync_and_async_methods_agree() -> None:
    """One method per RPC, shared by both clients: its builder's parameters and docstring,
    a request of the RPC's type. The one each client writes itself (``list_pools``)
    has the same parameters and docstring; the sync method returns the
    response, the async one a coroutine of it."""
    ns = {**vars(client_module), **vars(aio_module), "pb": pb}
    own = {"list_pools"}
    for name, rpc in UNARY_METHODS.items():
        assert typing.get_type_hints(rpc.build, vars(rq))["return"] is rpc.request, name
        sync, aio = getattr(KVCoordClient, name), getattr(AsyncKVCoordClient, name)
        if name not in own:
            assert sync is aio is rpc, name
            bound = rpc.__get__(_Sent())
            assert inspect.signature(bound) == inspect.signature(rpc.build).replace(
                return_annotation=inspect.Signature.empty
            ), name
            assert bound.__doc__ == rpc.build.__doc__ and bound.__doc__, name
            continue
        assert list(inspect.signature(sync).parameters.values()) == list(
            inspect.signature(aio).parameters.values()
        ), name
        assert typing.get_type_hints(sync, ns)["return"] is rpc.response, name
        returned = typing.get_type_hints(aio, ns)["return"]
        assert typing.get_origin(returned) is Coroutine, name
        assert typing.get_args(returned)[-1] is rpc.response, name
        assert sync.__doc__ == aio.__doc__, name


class _Sent:
    """A client whose transport records what it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def unary(self, rpc: object, request: object) -> object:
        self.sent.append((rpc.name, request))  # type: ignore[attr-defined]
        return "answer"


def test_a_shared_method_sends_its_builders_request() -> None:
    """``client.free(...)`` sends ``_requests.free(...)`` as the Free RPC and returns
    what the transport returns (each client's ``unary``: a response or a coroutine)."""
    client = _Sent()
    assert KVCoordClient.free.__get__(client)("p", ["a"], session_id="s") == "answer"
    ((name, request),) = client.sent
    assert name == "Free"
    assert isinstance(request, pb.FreeRequest)
    assert (request.pool, list(request.request_ids), request.session_id) == ("p", ["a"], "s")
    assert request.idempotency_key


def test_keyed_calls_are_numbered_in_the_order_they_are_built() -> None:
    """Every keyed call the builders make carries a call_sequence, strictly increasing
    (the server refuses a copy of one delivered after its key was forgotten), and
    send_step numbers a Step built without a key."""
    op = pb.AllocateOp(request=pb.RequestSync(request_id="r"))
    built = [
        rq.allocate("p", op, "s"),
        rq.free("p", ["r"], session_id="s"),
        rq.step("p", [], "s"),
        rq.allocate("p", op, "s"),
    ]
    numbers = [r.call_sequence for r in built]
    assert all(numbers) and numbers == sorted(set(numbers))
    sent: list[pb.StepRequest] = []

    class _Steps(KVCoordClient):
        def __init__(self) -> None:  # (no channel)
            self.step_piece_bytes = 0

        def _call(self, rpc: str, request: object) -> pb.StepResponse:
            sent.append(typing.cast(pb.StepRequest, request))
            return pb.StepResponse()

    _Steps().send_step(pb.StepRequest(pool="p", session_id="s"))
    (step,) = sent
    assert step.idempotency_key and step.call_sequence > numbers[-1]
