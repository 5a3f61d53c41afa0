"""A journal written by kvcoord before 863d21c, whose snapshot at an instance's own
``start`` record lacks that instance's restore generation (positions.py,
"Generations"), starts on this kvcoord holding what its clients were told; a journal
that does not match what its clients were told still refuses to start.

The data directory in data/start_snapshot_journal/ was written by that kvcoord
(data/make_start_snapshot_journal.py: a restore proven, then a restart whose start
record was snapshotted, then worker d's Step d1, told under the generation's key)."""

from __future__ import annotations

import json
import shutil
import sqlite3
import zlib
from pathlib import Path
from typing import Any

import cbor2
import pytest
from durable_server import DurableServer, leased_server, step_allocate
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.service.main import EXIT_CANNOT_START
from kvcoord.v1 import allocator_pb2 as pb

FIXTURE = Path(__file__).resolve().parent / "data" / "start_snapshot_journal"


def _server_on_fixture(tmp_path: Path) -> tuple[DurableServer, Any, list[int]]:
    """A server on a copy of the fixture's data directory: the server, worker d's
    session (as the fixture's client holds it) and the blocks d1 was told."""
    told = json.loads((FIXTURE / "worker-d.json").read_text())
    server = leased_server(tmp_path, told["lease"], num_blocks=told["num_blocks"])
    shutil.copytree(FIXTURE, server.data_dir, ignore=shutil.ignore_patterns("worker-d.json"))
    f = told["fence"]
    fence = pb.Fence(
        instance_id=f["instance_id"], incarnation=f["incarnation"], term=f["term"], position=f["position"],
        position_tag=bytes.fromhex(f["position_tag"]),
    )  # fmt: skip
    return server, pb.AttachResponse(session_id=told["session_id"], fence=fence), told["d1"]


def _held(c: KVCoordClient, rid: str) -> list[list[int]]:
    inspected = c.inspect_pool("p", all_requests=True)
    return [list(r.groups[0].block_ids) for r in inspected.requests if r.request_id == rid]


def test_a_journal_whose_start_snapshot_lacks_the_instances_generation_starts(tmp_path: Path) -> None:
    """The snapshot at the start record says the instance started in generation 0;
    its Step after the snapshot was told under the restore's generation. The replay
    finds the answer equal to what its client was told once tagged under that
    generation's key, and from then on the instance's positions are that generation's:
    the server starts holding d1, worker d goes on with its fence, and so across a
    later restart (its snapshot holds the generation). (Before: exit 3, "record 12
    cannot be replayed: ... gives a different answer where its client was told an
    answer".)"""
    server, d, held = _server_on_fixture(tmp_path)
    try:
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            assert _held(c, "d1") == [held]
            d.fence.CopyFrom(c.step("p", [], d.session_id, d.fence).fence)
            more = step_allocate(c, d, "d2", 8)
            assert not set(more) & set(held)
        server.kill()
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            assert _held(c, "d1") == [held] and _held(c, "d2") == [more]
            d.fence.CopyFrom(c.step("p", [], d.session_id, d.fence).fence)
    finally:
        server.stop()


def test_that_journal_with_an_answer_its_client_was_not_told_still_refuses_to_start(tmp_path: Path) -> None:
    """The same journal, but record 12 says its client was told another answer (a
    byte of its digest changed): under neither generation's key does the replayed
    answer match, and the server refuses to start naming the record."""
    server, _, _ = _server_on_fixture(tmp_path)
    journal = sqlite3.connect(server.data_dir / "journal.sqlite")
    try:
        (body,) = journal.execute("SELECT body FROM records WHERE seq = 12").fetchone()
        record = cbor2.loads(body)
        assert record[0] == "call" and record[2] == "Step"
        record[-1] = bytes([record[-1][0] ^ 1]) + record[-1][1:]
        body = cbor2.dumps(record)
        journal.execute("UPDATE records SET body = ?, crc = ? WHERE seq = 12", (body, zlib.crc32(body)))
        journal.commit()
    finally:
        journal.close()
    try:
        with pytest.raises(RuntimeError, match=f"exited with {EXIT_CANNOT_START}") as raised:
            server.start()
    finally:
        server.stop()
    assert "record 12 cannot be replayed" in str(raised.value)
    assert "gives a different answer where its client was told an answer" in str(raised.value)
