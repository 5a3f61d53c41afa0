"""Generated protobuf messages and gRPC stubs of the ``kvcoord.v1`` wire contract.

Generated from ``proto/kvcoord/v1/*.proto`` by ``scripts/gen_protos.py`` (grpcio-tools
1.85.1); never edit the ``*_pb2*`` modules by hand. Import them with an alias at the
edge: ``from kvcoord.v1 import allocator_pb2 as pb``.
"""
