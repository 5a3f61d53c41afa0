"""A journaled server whose process cannot fork (a pids limit, memory: fork fails with
EAGAIN) answers every call truly: the snapshot a call's record makes due is then taken
on the loop, never turned into an error for a call that was applied; and a restart
(SIGKILL) recovers every answered allocation.

The server is a real process; a ``sitecustomize`` first on its PYTHONPATH makes
``os.fork`` fail the way a pids limit does (support.fork_refused_env).
"""

from __future__ import annotations

from pathlib import Path

from durable_server import env
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import start_server
from kvcoord.v1 import allocator_pb2 as pb
from support import allocate_each_answered_truly, fork_refused_env, held_blocks


def test_a_snapshot_whose_fork_is_refused_is_taken_here_and_no_applied_call_fails(tmp_path: Path) -> None:
    e = fork_refused_env(env(), tmp_path / "hook")
    text = f'[server]\ndata_dir = "{tmp_path / "data"}"\nsynchronous = "NORMAL"\nsnapshot_every = 16\n'
    cfg = pb.PoolConfig(
        num_blocks=1024, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
    )  # fmt: skip
    server = start_server(text, env=e)
    try:
        with KVCoordClient(server.address, timeout=30.0) as c:
            c.create_pool("p", cfg)
            # 16 blocks each; a snapshot falls due among them
            answered = allocate_each_answered_truly(c, "p", 24, 64)
        server.proc.kill()
        server.stop()
        server = start_server(text, startup_timeout=60.0, env=e)
        with KVCoordClient(server.address, timeout=30.0) as c:
            assert held_blocks(c, "p") == answered
    finally:
        server.stop()
