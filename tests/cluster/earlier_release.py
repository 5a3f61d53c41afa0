"""A replica of an earlier kvcoord release, played by a server hook: its Replicas service
offers only the methods that release had (the others answer UNIMPLEMENTED, as a server
whose generated code lacks them does). Add :data:`HOOK` to a test's sitecustomize
(durable_server.with_sitecustomize) and start the replica with :func:`env_of`."""

from __future__ import annotations

#: the environment variable naming the methods the hooked replica serves, comma-separated
METHODS = "KVCOORD_TEST_REPLICAS_METHODS"

HOOK = f"""
import os

_methods = os.environ.get({METHODS!r})
if _methods is not None:  # an earlier release's Replicas service: only these methods
    import grpc
    from kvcoord.v1 import allocator_pb2 as _pb
    from kvcoord.v1 import allocator_pb2_grpc as _pb_grpc

    _service = _pb.DESCRIPTOR.services_by_name["Replicas"]

    def _earlier_release(servicer, server):
        handlers = {{}}
        for name in _methods.split(","):
            method = _service.methods_by_name[name]
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                getattr(servicer, name),
                request_deserializer=getattr(_pb, method.input_type.name).FromString,
                response_serializer=getattr(_pb, method.output_type.name).SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_service.full_name, handlers),))

    _pb_grpc.add_ReplicasServicer_to_server = _earlier_release
"""


def env_of(*methods: str) -> dict[str, str]:
    """The environment that makes a hooked replica serve only ``methods`` of Replicas
    (unary methods of the earlier release, e.g. "AdoptPool", "ScoreForTenant")."""
    return {METHODS: ",".join(methods)}
