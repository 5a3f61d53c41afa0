"""A restore proven by a worker's fence is told to that worker (INSTANCE_CHANGED) only
once the fencing's records (restored, expire, reset) are durable: the worker drops its
fence on hearing it, so nobody would prove the restore again. Checked by copying the
data directory as a SIGKILL leaves it right after the worker heard (or, when it has
not heard yet, it retries with its fence as any client does) and restarting on the
copy: no restored session alive, no prefix hit on blocks the lost history overwrote.
Three cases: fenced at once (the crash-free path), fenced at once on a slow disk (the
journal's writes held), and fenced once another pool's Step applied in slices is done
(journal_behind._fence_when_idle). Old code told the worker at once: on the slow disk and
mid-Step the copy kept the restored session and the stale prefix hit (silently wrong
KV)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, SessionExpiredError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import calls_in_threads, pool_toml

N = 32  # blocks (the null block aside: 31, of 4 tokens)


def _hashes(rid: str, n: int) -> list[bytes]:
    return [f"{rid}-{i}".encode().ljust(32, b".") for i in range(n // 4)]


def _alloc(c: KVCoordClient, s: Any, rid: str, n: int) -> list[int]:
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=list(range(n)), new_request=True, append_block_hashes=_hashes(rid, n)
    )
    r = c.step(
        "p", [pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=n))], s.session_id, s.fence
    )
    s.fence.CopyFrom(r.fence)
    assert r.results[0].status_code == 0, r
    return list(r.results[0].allocate.new_block_ids[0].block_ids)


@pytest.mark.parametrize("crash", [False, True, "mid_step"])
def test_a_proven_restore_survives_a_crash_right_after_it_is_told(
    make_server: Callable[..., InProcessServer], tmp_path: Path, crash: bool
) -> None:
    data, copy, image = tmp_path / "data", tmp_path / "copy", tmp_path / "image"
    toml = pool_toml("p", N) + pool_toml("q", 16, caching=False)
    warm = _hashes("warm", 16)
    server = make_server(toml, data_dir=str(data))
    with KVCoordClient(server.address, retry=NO_RETRY) as c:
        a = c.attach("p", "sha256_cbor", 4, "0", "worker-a", lease_seconds=60)
        b = c.attach("p", "sha256_cbor", 4, "0", "worker-b", lease_seconds=60)
        warm_blocks = _alloc(c, b, "warm", 16)
        c.free("p", ["warm"], session_id=b.session_id, fence=b.fence)
        subprocess.run(["cp", "-a", str(data), str(copy)], check=True)  # the backup
        lost = _alloc(c, a, "a2", 4 * (N - 1))  # the lost history overwrites warm's blocks
        assert set(warm_blocks) <= set(lost)
    server.stop(snapshot=False)
    shutil.rmtree(data)
    subprocess.run(["cp", "-a", str(copy), str(data)], check=True)  # the restore (no --restored)

    restored = make_server(toml, data_dir=str(data))
    writer = restored.running.servicer.registry.recorder.journal  # type: ignore[union-attr]
    store = writer.store
    release = threading.Event()
    real_write = store.write

    def slow_write(*args: Any, **kw: Any) -> Any:  # a slow disk (on the journal's thread)
        release.wait(20)
        return real_write(*args, **kw)

    registry = restored.running.servicer.registry
    if crash is True:
        store.write = slow_write
    elif crash == "mid_step":  # pool q held as a Step applied to it in slices holds it
        restored.call(lambda: registry.locks.take("q"))
    # worker a's next call proves the restore (INSTANCE_CHANGED)
    (prover,), told = calls_in_threads(
        restored.address, lambda c: c.heartbeat(a.session_id, a.fence), timeout=30
    )
    prover.join(1.0)
    if not crash:
        time.sleep(0.2)
    subprocess.run(["cp", "-a", str(data), str(image)], check=True)  # what a SIGKILL leaves now
    heard = bool(told)  # the worker heard INSTANCE_CHANGED before the crash: it dropped its fence
    release.set()
    if crash == "mid_step":
        restored.call(lambda: registry.locks.give("q"))
    prover.join(30)
    assert told and isinstance(told[0], FencedError), told
    restored.stop(snapshot=False)

    again = make_server(toml, data_dir=str(image))
    # Before any worker of the lost history calls again: when the crash came after the
    # proof's grace was written (grace.json) and before its fencing was committed, the
    # restart fences at start (test_restore_fencing_killed.py); b, whose fence proves
    # nothing, calls first (it used to be served from the copy until a's retry).
    with KVCoordClient(again.address, retry=NO_RETRY) as c:
        hit = c.find_longest_cache_hit("p", warm, 16).hit.num_tokens
        try:
            c.heartbeat(b.session_id, b.fence)
            b_alive = True
        except Exception:  # noqa: BLE001
            b_alive = False
    if not heard:  # it never heard: it calls again with its fence, as any client retries
        with KVCoordClient(again.address, retry=NO_RETRY) as c:
            # told its loss: INSTANCE_CHANGED, or SESSION_EXPIRED once the restart fenced
            # (what every worker of the lost history hears on a Heartbeat after a fencing)
            with pytest.raises((FencedError, SessionExpiredError)):
                c.heartbeat(a.session_id, a.fence)
    print(
        "crash",
        crash,
        "heard before the crash",
        heard,
        "stale hit tokens",
        hit,
        "restored session b alive",
        b_alive,
    )
    assert hit == 0, f"a prefix hit of {hit} tokens on blocks {warm_blocks} the lost history overwrote"
    assert not b_alive, "a session of the restored journal survived the proven restore"
