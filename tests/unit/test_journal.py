"""The journal and recovery in plain Python: the servicer's handlers are called
directly (no gRPC), the "crash" abandons a node without closing anything, and a new
node recovers from the same data directory."""

from __future__ import annotations

import asyncio
import random
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from kvcoord.client import _requests as rq
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.conformance import load_trace, replay
from kvcoord.conformance.remote import RemoteTarget
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.journal import JournalError, JournalStore
from kvcoord.service.recovery import Recovery, open_journal
from kvcoord.service.registry import Limits, PoolRegistry
from kvcoord.service.servicer import AllocatorServicer
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import allocate_op
from support import wire_pool_config

DATA = Path(__file__).resolve().parents[1] / "conformance" / "data"
NONE = none_hash("sha256_cbor", "0")


class Aborted(Exception):
    def __init__(self, code: Any, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class _Context:
    async def abort(self, code: Any, message: str, trailers: Any = ()) -> None:
        raise Aborted(code, message)


CTX = _Context()


class Node:
    """One server instance: registry + servicer recovered from ``data_dir``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, data_dir: Path, snapshot_every: int = 10_000) -> None:
        self.loop = loop
        self.clock = ManualClock()
        sessions = SessionTable(self.clock, 30.0, 60.0)
        self.registry = PoolRegistry(Limits(), sessions, IdempotencyStore(self.clock, 300.0, 1 << 20))

        async def recover() -> Recovery:
            return open_journal(self.registry, str(data_dir), "OFF", snapshot_every)

        self.recovery = loop.run_until_complete(recover())
        self.servicer = AllocatorServicer(self.registry)

    def call(self, rpc: str, request: Any) -> Any:
        return self.loop.run_until_complete(getattr(self.servicer, rpc)(request, CTX))

    def settle(self) -> None:
        """Wait until the snapshot being taken (if any) is in the journal, and compacted."""
        recorder = self.recovery.recorder
        task = getattr(recorder, "snapshot_task", None)
        if task is not None:
            self.loop.run_until_complete(task)
        self.loop.run_until_complete(recorder.durable())
        task = recorder.journal._task
        if task is not None:
            self.loop.run_until_complete(task)

    def crash(self) -> None:
        """Stop the writer thread and forget the node (nothing is flushed or closed)."""
        self.recovery.recorder.journal._executor.shutdown(wait=True)


class DirectClient:
    """The KVCoordClient methods RemoteTarget uses, calling a node's handlers."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def create_pool(self, name: str, config: pb.PoolConfig) -> Any:
        return self.node.call("CreatePool", pb.CreatePoolRequest(name=name, config=config))

    def attach(
        self, pool: str, algo: str, size: int, seed: str, client_name: str = "", profile: str = ""
    ) -> Any:
        return self.node.call("Attach", rq.attach(pool, algo, size, seed, client_name, 0, profile=profile))

    def step(self, pool: str, ops: list[pb.Operation], session_id: str, fence: pb.Fence | None = None) -> Any:
        return pb.StepResponse.FromString(self.node.call("Step", rq.step(pool, ops, session_id, fence)))

    def inspect_pool(self, pool: str, free_queue_limit: int = 0) -> Any:
        return self.node.call(
            "InspectPool", pb.InspectPoolRequest(pool=pool, free_queue_limit=free_queue_limit)
        )

    def delete_pool(self, name: str) -> Any:
        return self.node.call("DeletePool", pb.DeletePoolRequest(name=name))

    def close(self) -> None:
        pass


def state_of(node: Node) -> Any:
    """Everything recovery must bring back, comparable across nodes."""
    r = node.registry
    pools = {
        name: (
            p.fence.incarnation,
            p.engine.snapshot(),
            p.engine.lookup_counters,
            p.events.kept(),
            p.events.last_sequence,
            [(rid, s.session_id) for rid, s in p.owners.items()],
        )
        for name, p in r.pools.items()
    }
    sessions = [
        (s.session_id, s.pool, s.client_name, s.lease_seconds, list(s.owned), s.events_cursor, s.stats)
        for s in r.sessions.sessions.values()
    ]
    answers = [(e[0], e[1], e[2], e[3], e[5]) for e in r.idempotency.export()]
    return pools, sessions, answers


@pytest.fixture
def loop() -> Any:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


TRACES = [
    "hybrid_full16_swa16_w32_swa16_w128",
    "hybrid_full16_mamba16_all_mtp_k2",
    "encdec_full16_cross16_nocache",
    "hybrid_full16_chunked16_c64",
]


@pytest.mark.parametrize("name", TRACES)
def test_trace_survives_crashes_with_exact_state(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, name: str
) -> None:
    """A trace replayed through the servicer passes (events, stats, free queue included)
    while the node is abandoned at 6 random points and recovered from its journal
    (snapshots every 97 records); at every crash the recovered state equals the lost one."""
    trace = load_trace(DATA / f"{name}.jsonl")
    rnd = random.Random(name)
    crash_at = set(rnd.sample(range(5, len(trace.ops) // 2), 6))
    node = Node(loop, tmp_path, snapshot_every=97)
    target = RemoteTarget("127.0.0.1:1")
    target.client.close()
    client = DirectClient(node)
    target.client = client  # type: ignore[assignment]
    calls = 0
    crashes = 0
    original = DirectClient.step

    def step(self: DirectClient, *args: Any) -> Any:
        nonlocal calls, crashes
        calls += 1
        if calls in crash_at:
            before = state_of(self.node)
            self.node.crash()
            self.node = Node(loop, tmp_path, snapshot_every=97)
            assert state_of(self.node) == before
            crashes += 1
        return original(self, *args)

    client.step = step.__get__(client)  # type: ignore[method-assign]
    result = replay(trace, target)
    assert result.passed, str(result.mismatch)
    assert crashes == 6
    assert client.node.recovery.snapshot_seq > 0  # recovery went through a snapshot


def test_keyed_answer_survives_and_is_not_applied_twice(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """A Step retried with its key after a crash gets the first answer, byte for byte,
    and the pool is as after one application."""
    a = Node(loop, tmp_path)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    tokens = list(range(12))
    sync = pb.RequestSync(
        request_id="r", append_token_ids=tokens, new_request=True,
        append_block_hashes=BlockHasher("sha256_cbor", 4, NONE).extend(tokens),
    )  # fmt: skip
    req = rq.step("p", [pb.Operation(allocate=allocate_op(sync, 12))], att.session_id, att.fence)
    first = a.call("Step", req)
    a.crash()
    b = Node(loop, tmp_path)
    again = b.call("Step", req)
    assert type(first) is bytes and again == first  # (answers are their kept bytes)
    assert b.registry.pools["p"].engine.num_free_blocks == a.registry.pools["p"].engine.num_free_blocks
    # the old fence (instance of a) is accepted; answers carry b's
    fresh = b.call("Heartbeat", pb.HeartbeatRequest(session_id=att.session_id, fence=att.fence))
    assert fresh.fence.instance_id == b.registry.instance_id != att.fence.instance_id
    assert fresh.fence.incarnation == att.fence.incarnation


def test_snapshot_compacts_the_journal(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
    """After a snapshot the file holds one snapshot and only the records after it."""
    a = Node(loop, tmp_path, snapshot_every=10)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    for _ in range(25):
        client.step("p", [pb.Operation(take_events=pb.TakeEventsOp())], att.session_id, att.fence)
        a.settle()  # each snapshot done before the next records (one being taken defers the next)
    journal = a.recovery.recorder.journal
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    snaps = db.execute("SELECT seq FROM snapshots").fetchall()
    records = [seq for (seq,) in db.execute("SELECT seq FROM records")]
    parts = db.execute("SELECT DISTINCT seq FROM snapshot_parts").fetchall()
    db.close()
    assert snaps == [(journal.snapshot_seq,)] == parts
    assert journal.snapshot_seq >= 20
    assert records == list(range(journal.snapshot_seq + 1, journal.appended + 1))


def _pool_config() -> pb.PoolConfig:
    return wire_pool_config(32, events=True)


def _write(store: JournalStore, n: int) -> None:
    for seq in range(1, n + 1):
        store.write([(seq, f"record {seq}".encode() * 20)])


def _copy_live(src: Path, dst: Path) -> Path:
    """Copy a journal while its writer still has it open (as after kill -9)."""
    dst.mkdir()
    for suffix in ("", "-wal"):
        shutil.copy(src / f"journal.sqlite{suffix}", dst / f"journal.sqlite{suffix}")
    return dst


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_torn_tail_is_dropped_and_earlier_records_kept(tmp_path: Path, damage: str) -> None:
    """The last transaction cut short (or with a damaged byte) in the WAL is dropped on
    open; every earlier one is read back intact."""
    live = JournalStore(tmp_path / "live", "FULL")
    _write(live, 5)
    copy = _copy_live(tmp_path / "live", tmp_path / "copy")
    live.close()
    wal = copy / "journal.sqlite-wal"
    data = bytearray(wal.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    else:
        data[-50] ^= 0xFF
    wal.write_bytes(bytes(data))
    store = JournalStore(copy)
    got = list(store.records(0))
    store.close()
    assert [seq for seq, _ in got] == [1, 2, 3, 4]
    assert got[-1][1] == b"record 4" * 20


def test_incompatible_version_is_refused_naming_the_file(tmp_path: Path) -> None:
    """A journal of another format version stops recovery with the file's path."""
    JournalStore(tmp_path).close()
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    db.execute("UPDATE meta SET value = '999' WHERE key = 'format_version'")
    db.commit()
    db.close()
    with pytest.raises(JournalError, match=r"journal\.sqlite has format version 999"):
        JournalStore(tmp_path)


def test_corrupt_snapshot_and_record_are_refused(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
    """A snapshot or a record whose checksum fails stops recovery, naming the file."""
    a = Node(loop, tmp_path, snapshot_every=3)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    for _ in range(4):
        client.step("p", [pb.Operation(take_events=pb.TakeEventsOp())], att.session_id, att.fence)
    a.settle()
    a.recovery.recorder.snapshot_every = 1 << 30  # records after the snapshot
    for _ in range(2):
        client.step("p", [pb.Operation(take_events=pb.TakeEventsOp())], att.session_id, att.fence)
    a.crash()
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    db.execute(
        "UPDATE records SET body = CAST(x'00' || body AS BLOB) WHERE seq = (SELECT max(seq) FROM records)"
    )
    db.commit()
    with pytest.raises(JournalError, match=r"journal\.sqlite: record \d+ is corrupt"):
        Node(loop, tmp_path)
    db.execute("UPDATE snapshots SET body = CAST(x'00' || body AS BLOB)")
    db.commit()
    db.close()
    with pytest.raises(JournalError, match=r"journal\.sqlite: the snapshot after record \d+ is corrupt"):
        Node(loop, tmp_path)


def test_a_journal_behind_what_it_committed_is_flagged(tmp_path: Path) -> None:
    """JournalStore.behind names a journal that holds less than was committed (an older
    backup put back), one that ran elsewhere and arrives without its progress file, and
    another journal's progress file; the journal reopened as it was, an empty one, and
    one written before progress files existed are not flagged."""
    live_dir = tmp_path / "live"
    store = JournalStore(live_dir)
    assert store.behind == ""
    _write(store, 3)
    backup = tmp_path / "backup.sqlite"
    copy = sqlite3.connect(backup)
    store.db.backup(copy)
    copy.close()
    store.write([(4, b"after the backup")])
    store.close()
    reopened = JournalStore(live_dir)
    assert reopened.behind == ""
    reopened.close()

    def put(journal: Path, directory: Path) -> JournalStore:
        directory.mkdir(exist_ok=True)
        for suffix in ("", "-wal", "-shm"):
            (directory / f"journal.sqlite{suffix}").unlink(missing_ok=True)
        shutil.copy(journal, directory / "journal.sqlite")
        return JournalStore(directory)

    restored = put(backup, live_dir)
    assert "ends at record 3 but record 4 was committed" in restored.behind
    restored.close()
    moved = put(backup, tmp_path / "moved")
    assert "journal.progress is missing" in moved.behind
    moved.close()
    (tmp_path / "moved" / "journal.progress").write_text("0123456789abcdef 00000000000000000003\n")
    other = JournalStore(tmp_path / "moved")
    assert "names another journal" in other.behind
    other.close()
    old = sqlite3.connect(backup)
    old.execute("DELETE FROM meta WHERE key = 'journal_id'")  # as an older kvcoord wrote it
    old.commit()
    old.close()
    trusted = put(backup, tmp_path / "old")
    assert trusted.behind == ""
    trusted.close()


def _busy_node(loop: asyncio.AbstractEventLoop, tmp_path: Path, steps: int, every: int = 1 << 30) -> Node:
    """A node whose pool went through ``steps`` Steps of a long request each (allocated,
    then freed), so records are large."""
    a = Node(loop, tmp_path, snapshot_every=every)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    hasher = BlockHasher("sha256_cbor", 4, NONE)
    for i in range(steps):
        tokens = [(i * 7 + j) % 30000 for j in range(64)]
        sync = pb.RequestSync(
            request_id=f"r{i}", append_token_ids=tokens, new_request=True,
            append_block_hashes=hasher.extend(tokens),
        )  # fmt: skip
        hasher = BlockHasher("sha256_cbor", 4, NONE)
        ops = [pb.Operation(allocate=allocate_op(sync, 64))]
        if i:
            ops.insert(0, pb.Operation(free=pb.FreeOp(request_id=f"r{i - 1}")))
        client.step("p", ops, att.session_id, att.fence)
    return a


def test_a_snapshot_is_encoded_off_the_loop_while_calls_are_answered(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """Scenario 8: a snapshot's state is encoded and written by a forked child while the
    event loop goes on answering (here the child is held until 10 more Steps were
    answered); it lands in the journal covering exactly the records before it, and a
    node recovered from it plus the later records equals the live one. (Before, the
    engine was pickled on the loop: every call waited for it.)"""
    a = _busy_node(loop, tmp_path, 20)
    recorder = a.recovery.recorder
    assert recorder.fork
    gate = tmp_path / "gate"
    real = recorder.dump

    def held() -> Any:  # runs in the child
        while not gate.exists():
            time.sleep(0.01)
        return real()

    recorder.dump = held

    async def take() -> Any:
        return recorder.snapshot()

    task = loop.run_until_complete(take())
    covered = a.recovery.recorder.journal.appended
    client = DirectClient(a)
    att = client.attach("p", "sha256_cbor", 4, "0")
    for _ in range(10):
        client.step("p", [pb.Operation(take_events=pb.TakeEventsOp())], att.session_id, att.fence)
    assert not task.done()  # ten Steps answered while the child still holds the snapshot
    gate.touch()
    a.settle()
    assert recorder.snapshots == 1 and recorder.journal.snapshot_seq == covered
    before = state_of(a)
    a.crash()
    b = Node(loop, tmp_path)
    assert b.recovery.snapshot_seq == covered and b.recovery.records > 10
    assert state_of(b) == before


def test_a_snapshot_is_chunked_and_its_fingerprint_checked(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot is stored in chunks (here of 1 KiB; 16 MiB by default, far below
    SQLite's 1 GB value limit) and recovered whole; one of another format is refused
    with a message naming the file."""
    from kvcoord.service import journal_writer

    monkeypatch.setattr(journal_writer, "SNAPSHOT_CHUNK_BYTES", 1024)
    a = _busy_node(loop, tmp_path, 30, every=20)
    a.settle()
    before = state_of(a)
    a.crash()
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    (parts,) = db.execute("SELECT count(*) FROM snapshot_parts").fetchone()
    assert parts > 3
    b = Node(loop, tmp_path)
    assert b.recovery.snapshot_seq > 0
    assert state_of(b) == before
    b.crash()
    db.execute("UPDATE snapshots SET fingerprint = 'kvcoord-snapshot-1-py3.11-0123456789abcdef'")
    db.commit()
    db.close()
    with pytest.raises(
        JournalError, match=r"journal\.sqlite: the snapshot after record \d+ was written by an incompatible"
    ):
        Node(loop, tmp_path)


def test_space_is_given_back_after_a_snapshot(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
    """Scenario 12's disk: once a snapshot is in, the pages of the records it covers go
    back to the file system (incremental vacuum) and the WAL is checkpointed and
    truncated, on the journal's writer thread. (Before, the file never shrank and the
    WAL kept the size of the largest transaction.)"""
    a = _busy_node(loop, tmp_path, 400)
    path = tmp_path / "journal.sqlite"
    grown = path.stat().st_size + (tmp_path / "journal.sqlite-wal").stat().st_size

    async def take() -> Any:
        return a.recovery.recorder.snapshot()

    loop.run_until_complete(take())
    a.settle()
    db = sqlite3.connect(path)
    (free,) = db.execute("PRAGMA freelist_count").fetchone()
    (records,) = db.execute("SELECT count(*) FROM records").fetchone()
    db.close()
    assert records == 0 and free == 0
    assert (tmp_path / "journal.sqlite-wal").stat().st_size == 0
    assert path.stat().st_size < grown / 4


@pytest.mark.parametrize("snapshot_every", [1 << 30, 1])
def test_a_restore_detected_stays_detected_after_the_next_restart(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, snapshot_every: int
) -> None:
    """A restarted server that finds its journal behind what it committed (an older copy
    put back) voids every earlier instance's fences and journals that it did, so the
    restart after it does the same. The ``restored`` record may be the very record that
    starts a snapshot (here every record does; in service, whenever the records replayed
    reach ``snapshot_every``): that snapshot must hold the state after the change, or the
    next start, which replays only what follows the snapshot, brings the voided fences
    back (a fenced-out worker's calls accepted again, its stale Step taken for a second
    restore that ends the new sessions)."""
    data = tmp_path / "data"
    a = Node(loop, data)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    ops = [
        pb.Operation(
            allocate=allocate_op(
                pb.RequestSync(request_id="r0", new_request=True, append_token_ids=[1, 2, 3]), 3
            )
        )
    ]
    fence = client.step("p", ops, att.session_id, att.fence).fence
    a.settle()
    backup = tmp_path / "backup.sqlite"
    live, copy = sqlite3.connect(data / "journal.sqlite"), sqlite3.connect(backup)
    live.backup(copy)  # a backup taken while serving (deploy/README.md)
    live.close()
    copy.close()
    for i in range(1, 4):  # the worker is told of records the copy does not hold
        sync = pb.RequestSync(request_id=f"r{i}", new_request=True, append_token_ids=[1, 2, 3])
        fence = client.step("p", [pb.Operation(allocate=allocate_op(sync, 3))], att.session_id, fence).fence
    a.settle()
    a.crash()
    a.recovery.recorder.journal.store.close()  # (this process's handle: the files are replaced)
    old = a.registry.instance_id
    assert fence.instance_id == old and fence.position
    for suffix in ("-wal", "-shm"):
        (data / f"journal.sqlite{suffix}").unlink(missing_ok=True)
    shutil.copy(backup, data / "journal.sqlite")  # journal.progress stays: newer than the copy

    b = Node(loop, data, snapshot_every=snapshot_every)
    assert old not in b.registry.lineage and not b.registry.positions.ends
    b.settle()
    b.crash()

    c = Node(loop, data)
    assert old not in c.registry.lineage
    assert old not in c.registry.positions.ends
    with pytest.raises(Aborted, match="INSTANCE_CHANGED|instance"):
        c.call("ResetPrefixCache", pb.ResetPrefixCacheRequest(pool="p", fence=fence))


def test_a_record_naming_a_session_that_had_ended_stops_the_replay_naming_it(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """A Step journaled after its session's ``expire`` (as a restore fenced while the
    Step was applied in slices once wrote: tests/reliability/test_restore_holders.py),
    or an ``expire`` of a session never attached, cannot be replayed: recovery stops
    with a JournalError naming the record, the session and why, never a bare KeyError
    (and never skips the record)."""
    from kvcoord.service.durability import decode_record
    from kvcoord.service.journal_cbor import record_bytes

    a = Node(loop, tmp_path)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    sync = pb.RequestSync(request_id="r0", new_request=True, append_token_ids=[1, 2, 3])
    client.step("p", [pb.Operation(allocate=allocate_op(sync, 3))], att.session_id, att.fence)
    a.settle()
    a.crash()
    store = a.recovery.recorder.journal.store
    records = list(store.records(0))
    step = next(body for _, body in records if decode_record(body)[0] == "call")
    last = records[-1][0]
    store.write([(last + 1, record_bytes(("expire", time.time(), att.session_id))), (last + 2, step)])
    store.write_progress(last + 2)
    store.close()
    with pytest.raises(JournalError, match=rf"record {last + 2} cannot be replayed.*{att.session_id}.*ended"):
        Node(loop, tmp_path)
    store = JournalStore(tmp_path)
    store.db.execute("DELETE FROM records WHERE seq > ?", (last,))
    store.write([(last + 1, record_bytes(("expire", time.time(), "no-such-session")))])
    store.write_progress(last + 1)
    store.close()
    with pytest.raises(JournalError, match=rf"record {last + 1} cannot be replayed.*no-such-session"):
        Node(loop, tmp_path)


def _ended_holding(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, rule: int | None, reserve: bool
) -> tuple[Node, list[bytes], str]:
    """A session's request caches 3 full blocks (a router reserves their 12-token hit
    when ``reserve``), the server crashes and its journal gets the session's ``expire``
    record, its last field ``rule`` (None: none, as before the rule); the node restarted
    on it, the prompt's hashes and the reservation's id ("" without)."""
    from kvcoord.service.journal_cbor import record_bytes

    a = Node(loop, tmp_path)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    tokens = list(range(500, 513))  # 3 full blocks cached by the allocation
    hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)
    sync = pb.RequestSync(
        request_id="r0", new_request=True, append_token_ids=tokens, append_block_hashes=hashes
    )
    client.step("p", [pb.Operation(allocate=allocate_op(sync, 13))], att.session_id, att.fence)
    reservation = ""
    if reserve:
        prompt = pb.HashedPrompt(
            hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes
        )
        reserved = a.call("ScorePools", rq.score_pools(13, [prompt], reserve_seconds=5.0))
        assert reserved.reservation.hit_tokens == 12
        reservation = reserved.reservation.reservation_id
    a.settle()
    a.crash()
    store = a.recovery.recorder.journal.store
    last = list(store.records(0))[-1][0]
    record = ("expire", time.time(), att.session_id) + (() if rule is None else (rule,))
    store.write([(last + 1, record_bytes(record))])
    store.write_progress(last + 1)
    store.close()
    b = Node(loop, tmp_path)
    assert b.registry.pools["p"].num_requests == 0 and not b.registry.sessions.sessions
    return b, hashes, reservation


@pytest.mark.parametrize("abandoned", [False, True])
def test_a_session_end_replays_by_the_rule_its_record_was_written_under(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, abandoned: bool
) -> None:
    """A session's ``expire`` (or ``detach``) record ends with ABANDONED since its
    requests are freed as abandoned (the cache entries of blocks only they held
    dropped). A journal written before that rule has records without it: they replay
    as the server that wrote them freed (the hashes stay cached: a later journaled
    call's hit named them, and the replayed state must be the one its worker was
    told). Both replay to the state their writer had."""
    from kvcoord.service.durability import ABANDONED

    b, hashes, _ = _ended_holding(loop, tmp_path, ABANDONED if abandoned else None, False)
    assert b.registry.pools["p"].find_longest_cache_hit(hashes, 13).num_tokens == (0 if abandoned else 12)


@pytest.mark.parametrize("rule,hit", [(None, 12), (1, 12), (2, 0)])
def test_a_session_end_beside_a_reservation_replays_by_its_record_s_rule(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, rule: int | None, hit: int
) -> None:
    """A router reserved the hit of a request's 3 cached blocks, then the session ended
    holding the request. Its record's last field names the rule it was freed by: none
    (plainly) and durability.ABANDONED (abandoned, the reservation keeping the entries
    of blocks it holds) replay as the servers that wrote them kept those entries (a
    later journaled call's hit may name them); ABANDONED_PAST_RESERVATIONS, what a
    server writes now, replays without them, as it freed."""
    from kvcoord.service.durability import ABANDONED, ABANDONED_PAST_RESERVATIONS

    assert (ABANDONED, ABANDONED_PAST_RESERVATIONS) == (1, 2)
    b, hashes, reservation = _ended_holding(loop, tmp_path, rule, True)
    service = b.registry.pools["p"]
    assert service.expired_reservations() == [reservation]  # (no lease: released next)
    assert service.find_longest_cache_hit(hashes, 13).num_tokens == hit


def test_an_exclusive_attach_that_fails_leaves_no_session_behind_a_snapshot(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exclusive Attach that asks for the engine's state waits while it is encoded
    (off the loop, for a large pool), and the new session exists meanwhile. A snapshot
    started then (by any record) holds that session; if the state then cannot be sent
    (the export failed, the answer too large, the call cancelled) the session ends. The
    journal must say so: else the next start finds the session in the snapshot, alive
    with a fresh lease, and the pool is held exclusively by nobody (every Attach
    refused) until that lease runs out."""
    from kvcoord.service import session_calls
    from kvcoord.service.state_export import ExportError

    a = Node(loop, tmp_path)
    client = DirectClient(a)
    client.create_pool("p", _pool_config())

    async def snapshot_then_fail(service: Any, namespace: str) -> Any:
        task = a.recovery.recorder.snapshot()  # (any record could have started it now)
        assert task is not None
        await task
        raise ExportError("the encoder died")

    monkeypatch.setattr(session_calls, "mirror_state_apart", snapshot_then_fail)
    request = rq.attach(
        "p", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True, want_engine_state=True
    )
    with pytest.raises(Aborted, match="exporting the pool's state failed"):
        a.call("Attach", request)
    assert not a.registry.sessions.sessions
    monkeypatch.undo()
    a.settle()
    a.crash()

    b = Node(loop, tmp_path)
    assert not b.registry.sessions.sessions
    attached = DirectClient(b).attach("p", "sha256_cbor", 4, "0")  # (not refused: nobody holds the pool)
    assert attached.session_id


def test_a_pool_adopted_from_another_replica_shows_its_events_once_journaled(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """A handover brings the pool's kept events (registry_state.dump_pool); once the
    adopting replica's ``adopt`` record is durable they are watchers' (was: none until
    the pool's next Step, so every watcher resuming on the new owner was told to start
    over, and its publisher sent nothing)."""
    from kvcoord.service.registry_state import adopt_pool, dump_pool

    a = Node(loop, tmp_path / "a")
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    hasher = BlockHasher("sha256_cbor", 4, NONE)
    sync = pb.RequestSync(request_id="r", new_request=True, append_token_ids=list(range(8)),
                          append_block_hashes=hasher.extend(list(range(8))))  # fmt: skip
    client.step("p", [pb.Operation(allocate=allocate_op(sync, 8))], att.session_id, att.fence)
    value = dump_pool(a.registry, "p")
    kept = a.registry.pools["p"].events.last_sequence
    assert kept

    b = Node(loop, tmp_path / "b")
    service = adopt_pool(b.registry, value)
    b.recovery.recorder.adopted(value, service)
    b.settle()
    assert service.events.last_sequence == kept
    assert service.events.visible_sequence == kept


def test_steps_applied_in_slices_still_compact_the_journal(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """A Step applied in slices (a long prefill, a large decode batch, any batch on a
    loaded server: longer than SLICE_SECONDS) appends its record while its pool is
    still held, when no snapshot may start; the snapshot it made due is taken once the
    pool is given back. Here every Step is sliced: the journal is compacted every
    ``snapshot_every`` records, and a restart from the compacted journal (its snapshot,
    then the records after it) brings back the live state exactly. (Before, no snapshot
    was ever taken: 60 Steps kept 60 records, the journal and the next start's replay
    grew without bound.)"""
    every = 10
    a = Node(loop, tmp_path, snapshot_every=every)
    a.servicer.mutations.slice_seconds = 0.0  # every Step cut after its first slice
    client = DirectClient(a)
    client.create_pool("p", _pool_config())
    att = client.attach("p", "sha256_cbor", 4, "0")
    a.settle()
    recorder = a.recovery.recorder
    taken = recorder.snapshots
    batch = 40  # operations per Step: several slices of SLICE_OPS
    for i in range(60):
        ops = [pb.Operation(free=pb.FreeOp(request_id=f"r{i - 1}.{k}")) for k in range(batch) if i]
        for k in range(batch):
            tokens = [(i * batch + k + j) % 30000 for j in range(8)]
            sync = pb.RequestSync(
                request_id=f"r{i}.{k}", append_token_ids=tokens, new_request=True,
                append_block_hashes=BlockHasher("sha256_cbor", 4, NONE).extend(tokens),
            )  # fmt: skip
            ops.append(pb.Operation(allocate=allocate_op(sync, 8)))
        assert all(r.status_code == 0 for r in client.step("p", ops, att.session_id, att.fence).results)
        a.settle()
    assert recorder.snapshots - taken >= 60 // every - 1
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    (kept,) = db.execute("SELECT count(*) FROM records").fetchone()
    db.close()
    assert kept < 2 * every
    live = state_of(a)
    a.crash()
    b = Node(loop, tmp_path, snapshot_every=every)
    assert b.recovery.snapshot_seq > 0 and b.recovery.records < 2 * every
    assert state_of(b) == live


@pytest.mark.parametrize("fork", [True, False])
def test_a_snapshot_whose_file_cannot_be_written_leaves_no_file_behind(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork: bool
) -> None:
    """A snapshot whose file runs out of disk space half way (ENOSPC, in the forked
    child or on the encoding thread) fails alone: the journal keeps its records, the
    next snapshot is taken, and the partial file is removed at once. (Before, its
    ``.part.tmp`` stayed until the next start: a disk that was full for a moment stayed
    short of what the partial file held, and the journal's next writes could fail on
    it, stopping the server.)"""
    import errno

    import cbor2

    a = _busy_node(loop, tmp_path, 5)
    recorder = a.recovery.recorder
    recorder.fork = fork
    real = cbor2.dump

    def full(value: Any, f: Any) -> None:
        f.write(b"\0" * 65536)
        f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cbor2, "dump", full)

    async def take() -> Any:
        return recorder.snapshot()

    task = loop.run_until_complete(take())
    loop.run_until_complete(task)
    assert recorder.snapshot_failures == 1 and recorder.snapshots == 0
    assert not list(tmp_path.glob("snapshot-*")), list(tmp_path.glob("snapshot-*"))
    monkeypatch.setattr(cbor2, "dump", real)
    task = loop.run_until_complete(take())
    loop.run_until_complete(task)
    assert recorder.snapshots == 1 and recorder.journal.snapshot_seq == recorder.journal.appended
