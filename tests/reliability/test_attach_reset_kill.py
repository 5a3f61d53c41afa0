"""``kvcoord serve`` SIGKILLed between an Attach's prefix-cache reset
(AttachRequest.reset_prefix_cache) and the durability of its ``attach`` journal record.

The reset and the session are one record (attach_reset.py): after the restart on the
same data directory either both happened or neither, and the Attach retried with the
same attach_key then gets a session whose pool has no prefix-cache entry from before
the reset (nothing a previous engine cached is hit).

The kill is made to land in the window by a hook in the server process (a
``sitecustomize``): once FLAG exists, the journal's writer thread holds the batch that
carries a resetting ``attach`` record, either before writing it ("before": the reset
and the session are in memory only) or after committing it ("after": durable, the
answer not yet sent), and says so (FLAG + ".held"); the event loop goes on serving
reads meanwhile, which show the reset applied in memory. The server is killed there.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import durable_server
import pytest
from durable_server import DurableServer, small_pool
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.v1 import allocator_pb2 as pb

PROMPT = [9000 + i for i in range(41)]  # 10 full blocks of 4

#: the server process's ``sitecustomize``: while FLAG exists (holding "before" or
#: "after"), the journal write of a batch holding an ``attach`` record (the one Attach
#: sent meanwhile, which resets the prefix cache) is held there until the kill
_HOLD_RESET_ATTACH = """
import os
import time

import cbor2
from kvcoord.service import journal

_real = journal.JournalStore.write


def _attaches(records):
    return any(cbor2.loads(body)[0] == "attach" for _, body in records)


def _write(self, records, chunk=None):
    mode = open({flag!r}).read() if os.path.exists({flag!r}) else ""
    if not mode or not _attaches(records):
        return _real(self, records, chunk)
    if mode == "after":
        _real(self, records, chunk)
    open({flag!r} + ".held", "w").close()
    for _ in range(1200):  # the kill comes meanwhile
        time.sleep(0.1)
    raise OSError("held journal write was not killed")


journal.JournalStore.write = _write
"""


def _prompt() -> list[pb.HashedPrompt]:
    hashes = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(PROMPT)
    return [pb.HashedPrompt(hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes)]


def _hit(c: KVCoordClient) -> int:
    return c.score_pools(len(PROMPT), _prompt()).scores[0].hit_tokens


def _cached(c: KVCoordClient) -> list[int]:
    return sorted(c.inspect_pool("p", include_cached_blocks=True).cached_block_ids)


def _sessions(c: KVCoordClient) -> list[str]:
    return [s.session_id for s in c.list_sessions("p").sessions]


def _fill(c: KVCoordClient) -> None:
    """A previous engine's request, allocated and freed: its blocks stay cached."""
    s = c.attach("p", "sha256_cbor", 4, "0")
    sync = pb.RequestSync(
        request_id="old",
        append_token_ids=PROMPT,
        append_block_hashes=list(_prompt()[0].block_hashes),
        new_request=True,
    )
    got = c.allocate("p", pb.AllocateOp(request=sync, num_new_tokens=len(PROMPT)), s.session_id, s.fence)
    assert not got.result.refused
    c.free("p", ["old"], session_id=s.session_id, fence=s.fence)
    c.detach(s.session_id, s.fence)


@pytest.mark.parametrize("held", ["before", "after"])
def test_a_kill_between_an_attachs_reset_and_its_journal_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    flag = tmp_path / "hold-attach"
    durable_server.with_sitecustomize(tmp_path, _HOLD_RESET_ATTACH.format(flag=str(flag)), monkeypatch)
    server = DurableServer(tmp_path, small_pool(64))
    server.start()
    try:
        with KVCoordClient(server.address, timeout=10) as c:
            _fill(c)
            cached = _cached(c)
            assert len(cached) == 10 and _hit(c) == 40
        # one Attach, sent once and then retried with the same attach_key
        request = KVCoordClient.attach.build(
            "p", "sha256_cbor", 4, "0", "engine", lease_seconds=300.0, exclusive=True, reset_prefix_cache=True
        )
        flag.write_text(held)
        first: list[object] = []

        def attach_once() -> None:
            with KVCoordClient(server.address, timeout=120, retry=NO_RETRY) as c1:
                try:
                    first.append(c1.unary(KVCoordClient.attach, request))
                except KVCoordError as err:
                    first.append(err)

        sender = threading.Thread(target=attach_once)
        sender.start()
        deadline = time.monotonic() + 60
        while not Path(f"{flag}.held").exists():
            assert time.monotonic() < deadline and not first, first
            time.sleep(0.01)
        with KVCoordClient(server.address, timeout=10) as c:
            # in the window: the reset and the session are applied in memory, the
            # Attach not answered ("before": its record not even written)
            assert _cached(c) == [] and _hit(c) == 0
            (in_memory,) = _sessions(c)
        server.kill()
        flag.unlink()
        sender.join(60)
        assert len(first) == 1 and isinstance(first[0], KVCoordError), first  # never answered
        server.start()
        with KVCoordClient(server.address, timeout=30) as c:
            assert list(c.check_pool("p").violations) == []
            if held == "before":  # neither happened: no session, the cache as it was
                assert _sessions(c) == [] and _cached(c) == cached and _hit(c) == 40
            else:  # both happened: the session, and no entry from before the reset
                assert _sessions(c) == [in_memory] and _cached(c) == [] and _hit(c) == 0
            retried = c.unary(KVCoordClient.attach, request)
            assert retried.exclusive and retried.prefix_cache_reset
            assert _sessions(c) == [retried.session_id]
            if held == "after":  # the session the lost answer named
                assert retried.session_id == in_memory
            assert _cached(c) == [] and _hit(c) == 0
            assert list(c.check_pool("p").violations) == []
    finally:
        server.stop()
