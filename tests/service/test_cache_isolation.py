"""Prefix caches isolated by construction: the event-stream attack of issue 11."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from tenancy import Raw, pool_toml

ALICE, BOB = "tok-alice", "tok-bob"
CONFIG = f"""
[tenants.alice]
tokens = ["{ALICE}"]
grants = [{{ pools = ["shared*"], roles = ["use", "observe", "administer"] }}]

[tenants.bob]
tokens = ["{BOB}"]
grants = [{{ pools = ["shared*"], roles = ["use", "observe"] }}]
"""
CONFIG += pool_toml("shared") + pool_toml("shared-open", 'shared_cache_tenants = ["alice", "bob"]')

PROMPT = list(range(1000, 1032))  # 32 tokens = 8 blocks of 4
NONE = none_hash("sha256_cbor", "0")


def salted(tokens: list[int], salt: str | None) -> list[bytes]:
    return BlockHasher("sha256_cbor", 4, NONE, cache_salt=salt).extend(tokens)


def attach(raw: Raw, pool: str, token: str) -> str:
    request = pb.AttachRequest(pool=pool, hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0")
    return str(raw.ok("Attach", request, token).session_id)


def store(raw: Raw, pool: str, token: str, sid: str, rid: str, salt: str) -> list[bytes]:
    """Allocate (so cache) the prompt with the salt's hashes; returns the hashes."""
    h = salted(PROMPT, salt)
    sync = pb.RequestSync(request_id=rid, append_token_ids=PROMPT, append_block_hashes=h, new_request=True)
    raw.ok(
        "Allocate",
        pb.AllocateRequest(pool=pool, session_id=sid, op=pb.AllocateOp(request=sync, num_new_tokens=32)),
        token,
    )
    return h


def stolen_hashes(raw: Raw, pool: str, token: str) -> list[bytes]:
    """What an observer reads from WatchEvents: the BlockStored hashes, in order."""
    stream = raw.stub.WatchEvents(
        pb.WatchEventsRequest(pool=pool), metadata=[("authorization", f"Bearer {token}")], timeout=5
    )
    out: list[bytes] = []
    for message in stream:
        out.extend(message.event.block_stored.block_hashes)
        if len(out) >= 8:
            stream.cancel()
            break
    return out


def hits(
    raw: Raw, pool: str, token: str, sid: str, rid: str, block_hashes: list[bytes], tokens: list[int]
) -> list[int]:
    """The hit a request gets through each lookup path: FindLongestCacheHit, LookupOp, AllocateOp.lookup."""
    n = len(tokens) + 1
    extra = tokens + [0]
    found = raw.ok(
        "FindLongestCacheHit",
        pb.FindLongestCacheHitRequest(pool=pool, block_hashes=block_hashes, num_tokens=n),
        token,
    )
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=extra, append_block_hashes=block_hashes, new_request=True
    )
    step = raw.ok(
        "Step",
        pb.StepRequest(pool=pool, session_id=sid, ops=[pb.Operation(lookup=pb.LookupOp(request=sync))]),
        token,
    )
    sync2 = pb.RequestSync(
        request_id=rid + "-alloc", append_token_ids=extra, append_block_hashes=block_hashes, new_request=True
    )
    alloc = raw.ok(
        "Allocate",
        pb.AllocateRequest(
            pool=pool, session_id=sid, op=pb.AllocateOp(request=sync2, num_new_tokens=n, lookup=True)
        ),
        token,
    )
    return [found.hit.num_tokens, step.results[0].lookup.hit.num_tokens, alloc.result.hit.num_tokens]


@pytest.fixture
def iso(make_server: Callable[..., InProcessServer]) -> Iterator[Raw]:
    server = make_server(CONFIG)
    raw = Raw(server.address)
    yield raw
    raw.close()


def test_replayed_hashes_from_events_never_hit_another_tenants_blocks(iso: Raw) -> None:
    """Bob has Alice's salted block hashes (they are Alice's own hashes, as her client
    computed them; WatchEvents no longer shows them to him, tests/service/test_streams.py,
    but Alice, who administers the pool, reads them there), sends them with dummy tokens
    through every lookup path, and gets no hit; Alice looking up the same prompt hits 32
    tokens."""
    a, b = attach(iso, "shared", ALICE), attach(iso, "shared", BOB)
    alice_hashes = store(iso, "shared", ALICE, a, "a1", "alice-salt")
    stolen = stolen_hashes(iso, "shared", ALICE)
    assert stolen == alice_hashes  # events carry the client's hashes, not internal keys
    assert hits(iso, "shared", BOB, b, "b1", stolen, [0] * 32) == [0, 0, 0]
    assert hits(iso, "shared", ALICE, a, "a2", alice_hashes, PROMPT) == [32, 32, 32]
    assert iso.ok("CheckPool", pb.CheckPoolRequest(pool="shared"), ALICE).violations == []


def test_sharing_is_explicit_in_the_pool_config(iso: Raw) -> None:
    """In a pool whose shared_cache_tenants lists both, replayed hashes do hit (that is
    what sharing means), while honest clients stay apart by cache_salt: Bob hashing the
    same prompt with his own salt gets nothing, with Alice's salt everything."""
    a, b = attach(iso, "shared-open", ALICE), attach(iso, "shared-open", BOB)
    alice_hashes = store(iso, "shared-open", ALICE, a, "a1", "alice-salt")
    assert hits(iso, "shared-open", BOB, b, "b1", stolen_hashes(iso, "shared-open", BOB), [0] * 32)[0] == 32
    assert hits(iso, "shared-open", BOB, b, "b2", salted(PROMPT, "bob-salt"), PROMPT) == [0, 0, 0]
    assert hits(iso, "shared-open", BOB, b, "b3", alice_hashes, PROMPT) == [32, 32, 32]


def test_isolation_and_session_tenants_survive_a_restart(
    make_server: Callable[..., InProcessServer], tmp_path: Path
) -> None:
    """With a journal, a restarted server keeps each session's tenant (Bob cannot use
    Alice's session id) and each request's namespace (Bob still gets no hit, Alice does)."""
    data = str(tmp_path / "data")
    first = make_server(CONFIG, data_dir=data)
    raw = Raw(first.address)
    a = attach(raw, "shared", ALICE)
    alice_hashes = store(raw, "shared", ALICE, a, "a1", "alice-salt")
    raw.close()
    first.stop()
    second = make_server(CONFIG, data_dir=data)
    raw = Raw(second.address)
    try:
        code, _ = raw.call("Heartbeat", pb.HeartbeatRequest(session_id=a), BOB)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        raw.ok("Heartbeat", pb.HeartbeatRequest(session_id=a), ALICE)
        b = attach(raw, "shared", BOB)
        assert hits(raw, "shared", BOB, b, "b1", alice_hashes, [0] * 32) == [0, 0, 0]
        assert hits(raw, "shared", ALICE, a, "a2", alice_hashes, PROMPT) == [32, 32, 32]
    finally:
        raw.close()


def session_events(raw: Raw, pool: str, token: str, sid: str) -> tuple[list[int], list[bytes]]:
    """The token ids and stored hashes a session receives: Step include_state, then a TakeEventsOp."""
    out: tuple[list[int], list[bytes]] = ([], [])
    step = raw.ok("Step", pb.StepRequest(pool=pool, session_id=sid, include_state=True), token)
    take = raw.ok(
        "Step",
        pb.StepRequest(pool=pool, session_id=sid, ops=[pb.Operation(take_events=pb.TakeEventsOp())]),
        token,
    )
    for e in [*step.events, *take.results[0].take_events.events]:
        out[0].extend(e.block_stored.token_ids)
        out[1].extend(e.block_stored.block_hashes)
    return out


def test_a_session_receives_only_its_own_tenants_events(iso: Raw) -> None:
    """With isolated caches, Bob's session never receives Alice's BlockStored (her
    prompt's token ids and hashes) through Step include_state or TakeEventsOp; each
    tenant receives its own. In a pool that shares the cache, both receive both."""
    a, b = attach(iso, "shared", ALICE), attach(iso, "shared", BOB)
    alice_hashes = store(iso, "shared", ALICE, a, "a1", "alice-salt")
    assert session_events(iso, "shared", BOB, b) == ([], [])
    assert session_events(iso, "shared", ALICE, a) == (PROMPT, alice_hashes)
    bob_hashes = store(iso, "shared", BOB, b, "b1", "bob-salt")
    assert session_events(iso, "shared", ALICE, a) == ([], [])
    assert session_events(iso, "shared", BOB, b) == (PROMPT, bob_hashes)

    a, b = attach(iso, "shared-open", ALICE), attach(iso, "shared-open", BOB)
    alice_hashes = store(iso, "shared-open", ALICE, a, "a1", "alice-salt")
    assert session_events(iso, "shared-open", BOB, b) == (PROMPT, alice_hashes)
