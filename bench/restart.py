"""How long a replica with live requests is away during a rolling restart. Not a test.

    python bench/restart.py [--blocks 16384] [--requests 100] [--tokens 512]

One journaled ``kvcoord serve`` process (``synchronous = "FULL"``) with one pool of
``--blocks`` blocks (full attention, 4-token blocks) and one session holding
``--requests`` requests of ``--tokens`` tokens each. It is stopped with SIGTERM (what
``kubectl rollout`` and ``docker stop`` send: health turns NOT_SERVING, calls finish, a
snapshot is written) and a new process starts from the same data directory. Prints the
time from SIGTERM to the exit, from the new start to SERVING, and the data directory's
size; then checks that the session renews and every request is still held.
deploy/README.md ("Sizing", "Upgrade with sessions live") quotes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.testing import ServerProcess, start_server  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

BS = 4


def config(data_dir: Path, blocks: int) -> str:
    return f"""[server]
log_level = "WARNING"
durability = "journal"
data_dir = "{data_dir}"
synchronous = "FULL"

[[pools]]
name = "p"
num_blocks = {blocks}
hash_block_size = {BS}
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
[[pools.groups]]
type = "full"
block_size = {BS}
"""


def start(text: str) -> tuple[ServerProcess, float]:
    """A server process and the seconds from its launch to SERVING."""
    t0 = time.monotonic()
    server = start_server(text, env=_env())
    with KVCoordClient(server.address, timeout=5) as c:
        while c.health() != "SERVING":
            time.sleep(0.01)
    return server, time.monotonic() - t0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVCOORD_CONFIG", None)
    env["PYTHONPATH"] = f"{ROOT / 'client'}:{ROOT / 'server'}"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="kvcoord-restart-")) / "data"
    text = config(data, args.blocks)
    server, _ = start(text)
    with KVCoordClient(server.address, timeout=60) as c:
        s = c.attach("p", "sha256_cbor", BS, "0", "bench")
        for i in range(args.requests):
            sync = pb.RequestSync(
                request_id=f"r{i}", append_token_ids=list(range(args.tokens)), new_request=True,
                append_block_hashes=[f"{i}-{j}".encode().ljust(32, b".") for j in range(args.tokens // BS)],
            )  # fmt: skip
            op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=args.tokens))
            assert c.step("p", [op], s.session_id, s.fence).results[0].status_code == 0, (
                "refused: more blocks"
            )
    t0 = time.monotonic()
    status = server.stop(timeout=120)
    stopped = time.monotonic() - t0
    assert status == 0, server.log()
    server, started = start(text)
    try:
        with KVCoordClient(server.address, timeout=60) as c:
            c.heartbeat(s.session_id, s.fence)  # the same session, renewed by the new process
            assert c.get_stats("p").num_requests == args.requests
    finally:
        server.stop()
    size = sum(f.stat().st_size for f in data.iterdir())
    print(
        f"{args.blocks} blocks, {args.requests} requests x {args.tokens} tokens held "
        f"({args.requests * (args.tokens // BS)} blocks): SIGTERM to exit {stopped:.2f} s, "
        f"start to SERVING {started:.2f} s, data directory {size / 2**20:.1f} MiB; the session and "
        "its requests survived"
    )


if __name__ == "__main__":
    main()
