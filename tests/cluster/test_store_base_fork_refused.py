"""A replica whose process cannot fork (a pids limit, memory: fork fails with EAGAIN)
still answers every call truly with ``journal = "store"``: a large pool's base record,
due after a call's record, is then encoded on the loop, never turned into an error for
a call that was applied.

The server is a real process; a ``sitecustomize`` put first on its PYTHONPATH makes
``os.fork`` fail the way a pids limit does and lowers ``state_export.FORK_BLOCKS`` so a
small pool counts as large.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import start_server
from kvcoord.v1 import allocator_pb2 as pb
from support import allocate_each_answered_truly, fork_refused_env, held_blocks
from test_failover import _config, listed


def test_a_base_whose_fork_is_refused_is_encoded_here_and_no_applied_call_fails(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = request.node.name[:40]
    e = fork_refused_env(env(), tmp_path / "hook")
    cfg = pb.PoolConfig(
        num_blocks=1024, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
    )  # fmt: skip
    # a base every 4 records of the pool: several fall due among the allocations
    text = _config([etcd.endpoint], "solo", tmp_path / "solo", cluster, "store", 4)
    server = start_server(text, env=e)
    try:
        with KVCoordClient(server.address, timeout=30.0) as c:
            c.create_pool("big", cfg)
            answered = allocate_each_answered_truly(c, "big", 12, 128)  # 32 blocks each
        # the bases went to the store: a restart rebuilds the pool from it
        server.proc.kill()
        server.stop()
        server = start_server(text, startup_timeout=60.0, env=e)
        for _ in range(150):
            if "big" in listed([server.address]):
                break
            time.sleep(0.2)
        with KVCoordClient(server.address, timeout=30.0) as c:
            assert held_blocks(c, "big") == answered
    finally:
        server.stop()
