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
from kvcoord.client import KVCoordClient, KVCoordError
from kvcoord.client.testing import start_server
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from test_failover import _config, listed

SITECUSTOMIZE = """
import errno
import os

import kvcoord.service.state_export as _export

_export.FORK_BLOCKS = 16


def _refused():
    raise OSError(errno.EAGAIN, "Resource temporarily unavailable (fork refused by the test)")


os.fork = _refused
"""


def test_a_base_whose_fork_is_refused_is_encoded_here_and_no_applied_call_fails(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = request.node.name[:40]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    e = env()
    e["PYTHONPATH"] = f"{hook}:{e['PYTHONPATH']}"
    cfg = pb.PoolConfig(
        num_blocks=1024, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
    )  # fmt: skip
    # a base every 4 records of the pool: several fall due among the allocations
    text = _config([etcd.endpoint], "solo", tmp_path / "solo", cluster, "store", 4)
    server = start_server(text, env=e)
    answered: dict[str, list[int]] = {}
    failed: dict[str, KVCoordError] = {}
    try:
        with KVCoordClient(server.address, timeout=30.0) as c:
            c.create_pool("big", cfg)
            s = c.attach("big", "sha256_cbor", 4, "0", lease_seconds=600)
            for n in range(12):
                rid = f"r{n}"
                tokens = list(range(n * 128, (n + 1) * 128))  # 32 blocks each
                try:
                    got = c.allocate(
                        "big", allocate(rid, tokens, len(tokens)).allocate, s.session_id, s.fence
                    )
                except KVCoordError as err:
                    failed[rid] = err
                    continue
                assert not got.result.refused
                answered[rid] = list(got.result.new_block_ids[0].block_ids)
            held = {
                r.request_id: list(r.groups[0].block_ids)
                for r in c.inspect_pool("big", all_requests=True).requests
            }
        # no call answered with an error was applied (an error that hides an applied
        # allocation makes its client free blocks it never knew it held, or reuse them)
        assert not (set(failed) & set(held)), f"applied, but answered {failed}"
        assert held == answered
        # the bases went to the store: a restart rebuilds the pool from it
        server.proc.kill()
        server.stop()
        server = start_server(text, startup_timeout=60.0, env=e)
        with KVCoordClient(server.address, timeout=30.0) as c:
            for _ in range(150):
                if "big" in listed([server.address]):
                    break
                time.sleep(0.2)
            view = c.inspect_pool("big", all_requests=True)
            assert {r.request_id: list(r.groups[0].block_ids) for r in view.requests} == answered
    finally:
        server.stop()
