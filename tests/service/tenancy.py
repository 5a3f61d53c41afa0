"""Shared pieces of the tenant tests: a config with tenants, raw calls with a token,
and a snapshot of everything a call could change (for "nothing changed" checks)."""

from __future__ import annotations

from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

ROOT_TOKEN = "root-token"  # only in auth_tokens: full access

TOKENS = {
    "admin": "tok-admin",  # administer + use + observe on a-*
    "user": "tok-user",  # use on a-*
    "watcher": "tok-watcher",  # observe on a-*
    "other": "tok-other",  # every role on b-*
}

POOL = """
[[pools]]
name = "{name}"
num_blocks = 64
hash_block_size = 4
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true
max_model_len = 256
{extra}

[[pools.groups]]
type = "full"
block_size = 4
"""

TENANTS = f"""
[server]
auth_tokens = ["{ROOT_TOKEN}"]

[tenants.admin]
tokens = ["{TOKENS["admin"]}"]
grants = [{{ pools = ["a-*"], roles = ["administer", "use", "observe"] }}]

[tenants.user]
tokens = ["{TOKENS["user"]}"]
identities = ["cn:worker-1"]
grants = [{{ pools = ["a-*"], roles = ["use"] }}]

[tenants.watcher]
tokens = ["{TOKENS["watcher"]}"]
grants = [{{ pools = ["a-*"], roles = ["observe"] }}]

[tenants.other]
tokens = ["{TOKENS["other"]}"]
grants = [{{ pools = ["b-*"], roles = ["administer", "use", "observe"] }}]
"""


def pool_toml(name: str, extra: str = "") -> str:
    return POOL.format(name=name, extra=extra)


def md(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


class Raw:
    """Typed-enough raw calls: ``raw.Step(request, token)`` returns (code, response)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.AllocatorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def call(self, rpc: str, request: Any, token: str | None) -> tuple[grpc.StatusCode, Any]:
        method = getattr(self.stub, rpc)
        try:
            if rpc == "WatchEvents":
                stream = method(request, metadata=md(token), timeout=3)
                first = next(stream)
                stream.cancel()
                return grpc.StatusCode.OK, first
            if rpc == "StepStream":  # one Step on a stream
                return grpc.StatusCode.OK, next(method(iter([request]), metadata=md(token), timeout=10))
            return grpc.StatusCode.OK, method(request, metadata=md(token), timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()

    def ok(self, rpc: str, request: Any, token: str | None = ROOT_TOKEN) -> Any:
        code, response = self.call(rpc, request, token)
        assert code == grpc.StatusCode.OK, (rpc, code, response)
        return response


def pool_state(raw: Raw, pool: str) -> tuple[bytes, ...]:
    """Everything observable about a pool, as bytes (InspectPool + GetStats + GetPool)."""
    inspect = raw.ok(
        "InspectPool",
        pb.InspectPoolRequest(
            pool=pool, free_queue_limit=1 << 20, all_requests=True, include_cached_blocks=True
        ),
    )
    stats = raw.ok("GetStats", pb.GetStatsRequest(pool=pool))
    stats.ClearField("limits")  # tenant_sessions depends on the caller
    info = raw.ok("GetPool", pb.GetPoolRequest(name=pool))
    return (
        inspect.SerializeToString(deterministic=True),
        stats.SerializeToString(deterministic=True),
        info.SerializeToString(deterministic=True),
    )


def server_state(raw: Raw) -> tuple[Any, ...]:
    """Every pool's state and the session count per tenant (as the root sees them)."""
    pools = raw.ok("ListPools", pb.ListPoolsRequest()).pools
    return tuple((p.name, pool_state(raw, p.name)) for p in pools)
