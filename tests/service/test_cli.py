"""The operator CLI as a user meets it: the real ``kvcoord`` command (a subprocess,
``python -m kvcoord.client.cli``; ``kvcoord.service.cli`` for ``serve``) against a real
server process, for the main paths and every documented error; formatting through
click's CliRunner."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from durable_server import ROOT, DurableServer, env, small_pool
from helpers import allocate, attach
from kvcoord.client import KVCoordClient, cli_common, cli_observe, cli_pools
from kvcoord.client import cli as client_cli
from kvcoord.client.routing import PoolRouter
from kvcoord.v1 import allocator_pb2 as pb
from ports import free_port

TOKEN = "operator-secret"
#: a tenant that may only use pool p (no observe, no administer)
WORKER_TOKEN = "worker-secret"
WORKER_TENANT = f"""
[tenants.worker]
tokens = ["{WORKER_TOKEN}"]
grants = [{{ pools = ["p"], roles = ["use"] }}]
"""
#: the pool's event buffer keeps this many events (older ones are dropped: gaps)
EVENT_BUFFER = 6


def kvcoord(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    e = env()
    e.pop("KVCOORD_TARGET", None)
    e.pop("KVCOORD_TOKEN", None)
    e.update(extra_env)
    # The module the `kvcoord` console script runs each command from (the script itself
    # finds `serve` through an entry point: tests/unit/test_commands.py).
    module = "kvcoord.service.cli" if args[:1] == ("serve",) else "kvcoord.client.cli"
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True, text=True, env=e, timeout=120, input="",
    )  # fmt: skip


def started_for_sigint(args: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """``args`` started as a shell starts a foreground command: SIGINT at its default, so
    Python installs its KeyboardInterrupt handler. A test run started as a background job
    of a non-interactive shell (``scripts/test.sh > log &``) has SIGINT ignored, an ignored
    signal stays ignored through exec, and Python then leaves it ignored (what a background
    job asks for): the test's SIGINT never arrived and the CLI ran until killed ("SIGINT
    did not end it" with nothing on stderr, citime2 and citime3). A handled signal is reset
    to its default by exec, so SIGINT is handled here for the moment of the start (a test
    runs on pytest's main thread, the only one that may set a handler)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(args, **popen)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Popen returns after the exec: the mask read here is the command's own
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            assert not int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)), f"{args}: SIGINT ignored"
    return proc


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The error a command printed: exactly one line, no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DurableServer]:
    tmp = tmp_path_factory.mktemp("cli")
    s = DurableServer(
        tmp,
        f"[limits]\nevent_buffer = {EVENT_BUFFER}\n"
        + small_pool(64).replace(
            "enable_caching = true", "enable_caching = true\nenable_kv_cache_events = true"
        )
        + WORKER_TENANT,
    )
    # a full-access operator token (auth_tokens) in the [server] table
    s.config.write_text(
        s.config.read_text().replace("[server]\n", f'[server]\nauth_tokens = ["{TOKEN}"]\n', 1)
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture
def client(server: DurableServer) -> Iterator[KVCoordClient]:
    with KVCoordClient(server.address, token=TOKEN) as c:
        yield c


def run(server: DurableServer, *args: str) -> subprocess.CompletedProcess[str]:
    return kvcoord(*args, KVCOORD_TARGET=server.address, KVCOORD_TOKEN=TOKEN)


def test_status_shows_each_pool_as_the_server_counts_it(server: DurableServer, client: KVCoordClient) -> None:
    """`kvcoord status` shows usage, hit rate, live requests and sessions per pool: the
    values GetStats answers, a session attached by another client included."""
    sid, fence = attach(client, "p")
    tokens = list(range(100, 124))
    client.step("p", [allocate("status-a", tokens, len(tokens))], sid, fence)
    client.step(
        "p", [allocate("status-b", tokens, len(tokens), lookup=True)], sid, fence
    )  # a lookup that hits
    try:
        proc = run(server, "status", "--json")
        assert proc.returncode == 0, proc.stderr
        rows = {r["pool"]: r for r in json.loads(proc.stdout)["pools"]}
        stats = client.get_stats("p")
        p = rows["p"]
        assert p["sessions"] >= 1
        assert p["sessions"] == stats.num_sessions
        assert p["live_requests"] == stats.num_requests >= 2
        assert p["blocks_used"] == stats.num_total_blocks - stats.num_free_blocks > 0
        assert p["blocks_total"] == 63
        q = stats.prefix_cache_stats
        assert q.hits > 0 and p["hit_rate"] == pytest.approx(q.hits / q.queries)
        assert p["coordinator"] == client.get_pool("p").pool.coordinator

        text = run(server, "status")
        assert text.returncode == 0, text.stderr
        header, *lines = text.stdout.splitlines()
        assert header.split()[:2] == ["POOL", "LAYOUT"] and "SESSIONS" in header and "REPLICA" not in header
        row = next(line for line in lines if line.split()[0] == "p")
        assert f"{p['blocks_used']}/63" in row and f"{100 * p['hit_rate']:.1f}%" in row
    finally:
        client.detach(sid, fence)


def test_pools_create_inspect_check_delete(server: DurableServer, client: KVCoordClient) -> None:
    """The pool commands act on the server: what `create` made, GetPool shows; `inspect`
    shows its block tables; `check` passes; `delete` removes it; then it is unknown (8)."""
    made = run(server, "pools", "create", "cli-made", "--num-blocks", "33", "--block-size", "8", "--json")
    assert made.returncode == 0, made.stderr
    info = client.get_pool("cli-made").pool
    assert (info.config.num_blocks, info.config.hash_block_size) == (33, 8)
    assert json.loads(made.stdout)["name"] == "cli-made"

    sid, fence = attach(client, "cli-made", block_size=8)
    client.step("cli-made", [allocate("r1", list(range(20)), 20, block_size=8)], sid, fence)
    inspected = run(server, "pools", "inspect", "cli-made", "--json")
    assert inspected.returncode == 0, inspected.stderr
    state = json.loads(inspected.stdout)["state"]
    reference = client.inspect_pool("cli-made", all_requests=True)
    assert [r["request_id"] for r in state["requests"]] == ["r1"]
    assert state["requests"][0]["groups"][0]["block_ids"] == list(reference.requests[0].groups[0].block_ids)
    text = run(server, "pools", "inspect", "cli-made")
    blocks = " ".join(map(str, reference.requests[0].groups[0].block_ids))
    assert f"r1: 0/20 tokens, blocks {blocks}" in text.stdout

    checked = run(server, "pools", "check", "cli-made")
    assert checked.returncode == 0 and checked.stdout.rstrip().endswith("OK"), checked.stdout + checked.stderr
    client.detach(sid, fence)

    deleted = run(server, "pools", "delete", "cli-made", "--yes")
    assert deleted.returncode == 0, deleted.stderr
    assert "cli-made" not in [p.name for p in client.list_pools().pools]
    for args in (
        ["pools", "check", "cli-made"],
        ["pools", "inspect", "cli-made"],
        ["events", "--pool", "cli-made"],
    ):
        proc = run(server, *args)
        assert proc.returncode == cli_common.EXIT_NOT_FOUND, (args, proc.stderr)
        assert "not found" in one_line_error(proc) and "cli-made" in proc.stderr


def test_pools_delete_of_a_pool_an_exclusive_session_holds(
    server: DurableServer, client: KVCoordClient
) -> None:
    """`pools delete` of a pool a running engine holds (an exclusive session) fails,
    naming that session's client, and deletes nothing; `--force` deletes it (old code:
    deleted at once, the engine's worker running on block ids the deletion voided)."""
    made = run(server, "pools", "create", "cli-held", "--num-blocks", "33", "--block-size", "8")
    assert made.returncode == 0, made.stderr
    attach(client, "cli-held", block_size=8, exclusive=True, client_name="engine-3")
    refused = run(server, "pools", "delete", "cli-held", "--yes")
    assert refused.returncode != 0
    assert "exclusive session ('engine-3'" in refused.stderr and "with force" in refused.stderr, (
        refused.stderr
    )
    assert "cli-held" in [p.name for p in client.list_pools().pools]
    forced = run(server, "pools", "delete", "cli-held", "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "cli-held" not in [p.name for p in client.list_pools().pools]


def test_pools_delete_naming_an_incarnation_made_again_since(
    server: DurableServer, client: KVCoordClient
) -> None:
    """`pools delete --incarnation N` of a pool deleted and made again since (its
    incarnation is another now) fails in one line naming both incarnations and deletes
    nothing; naming the incarnation it is now deletes it."""
    made = run(server, "pools", "create", "cli-again", "--num-blocks", "33", "--block-size", "8")
    assert made.returncode == 0, made.stderr
    info = client.get_pool("cli-again").pool
    client.delete_pool("cli-again")
    new = client.create_pool("cli-again", info.config).pool.fence.incarnation
    old = info.fence.incarnation
    assert new != old
    refused = run(server, "pools", "delete", "cli-again", "--yes", "--incarnation", str(old))
    assert refused.returncode != 0
    line = one_line_error(refused)
    assert str(old) in line and str(new) in line and "nothing was deleted" in line, line
    assert client.get_pool("cli-again").pool.fence.incarnation == new
    deleted = run(server, "pools", "delete", "cli-again", "--yes", "--incarnation", str(new))
    assert deleted.returncode == 0, deleted.stderr
    assert "cli-again" not in [p.name for p in client.list_pools().pools]


def test_a_tenant_without_the_roles(server: DurableServer) -> None:
    """A tenant with only the use role sees the pool in `status` without its statistics
    (exit 0), and `sessions` (administer) is a refused credential: exit 7, one line."""
    proc = kvcoord("status", KVCOORD_TARGET=server.address, KVCOORD_TOKEN=WORKER_TOKEN)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.split()[0] == "p")
    assert row.split()[-5:] == ["?"] * 5
    as_json = kvcoord("status", "--json", KVCOORD_TARGET=server.address, KVCOORD_TOKEN=WORKER_TOKEN)
    (p,) = json.loads(as_json.stdout)["pools"]
    assert p["pool"] == "p" and p["unreadable"] and "blocks_used" not in p
    refused = kvcoord("sessions", "--pool", "p", KVCOORD_TARGET=server.address, KVCOORD_TOKEN=WORKER_TOKEN)
    assert refused.returncode == cli_common.EXIT_UNAUTHORIZED
    assert one_line_error(refused).startswith("kvcoord: permission denied")


def test_sessions_of_a_pool(server: DurableServer, client: KVCoordClient) -> None:
    """`kvcoord sessions --pool p` lists the pool's live sessions with their client name,
    requests and lease; a pool that does not exist is exit 8."""
    a, fa = attach(client, "p", client_name="worker-a", lease_seconds=60)
    b, fb = attach(client, "p", client_name="worker-b", lease_seconds=60)
    client.step(
        "p", [allocate("sess-1", list(range(40, 48)), 8), allocate("sess-2", list(range(50, 58)), 8)], a, fa
    )
    try:
        proc = run(server, "sessions", "--pool", "p", "--json")
        assert proc.returncode == 0, proc.stderr
        got = {s["session_id"]: s for s in json.loads(proc.stdout)["sessions"]}
        assert (got[a]["client_name"], got[a]["num_requests"]) == ("worker-a", 2)
        assert (got[b]["client_name"], got[b]["num_requests"]) == ("worker-b", 0)
        assert 0 < got[a]["expires_in_seconds"] <= got[a]["lease_seconds"] == 60
        text = run(server, "sessions", "--pool", "p")
        row = next(line for line in text.stdout.splitlines() if line.startswith(a))
        assert row.split()[1:4] == ["worker-a", "(full", "access)"] and row.split()[4] == "2"
        client.detach(b, fb)
        after = json.loads(run(server, "sessions", "--pool", "p", "--json").stdout)["sessions"]
        assert b not in {s["session_id"] for s in after} and a in {s["session_id"] for s in after}
    finally:
        client.detach(a, fa)
    unknown = run(server, "sessions", "--pool", "no-such-pool")
    assert unknown.returncode == cli_common.EXIT_NOT_FOUND
    assert "no-such-pool" in one_line_error(unknown)


def test_unreachable_server_and_refused_credential(server: DurableServer) -> None:
    """An unreachable server is exit 6, a refused or missing token exit 7: one line each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        for cmd in (["status"], ["pools", "check", "p"], ["events", "--pool", "p"]):
            proc = kvcoord(*cmd, "--target", dead)
            assert proc.returncode == cli_common.EXIT_UNREACHABLE, proc.stderr
            assert one_line_error(proc).startswith(f"kvcoord: server unreachable ({dead})")
    for token in ("wrong", ""):
        proc = kvcoord("status", KVCOORD_TARGET=server.address, KVCOORD_TOKEN=token)
        assert proc.returncode == cli_common.EXIT_UNAUTHORIZED, proc.stderr
        assert one_line_error(proc).startswith("kvcoord: credential refused")


def test_events_follow_resume_gap_and_reset(
    server: DurableServer, client: KVCoordClient, tmp_path: Path
) -> None:
    """`kvcoord events` streams the pool's events; with a state file a second run
    resumes after the last one read; events dropped from the buffer show a GAP line; a
    fence of another history shows a RESET line."""
    state = tmp_path / "events.json"
    sid, fence = attach(client, "p")
    try:
        client.step("p", [allocate("ev-1", list(range(500, 508)), 8)], sid, fence)
        first = run(server, "events", "--pool", "p", "--json", "--seconds", "1", "--state-file", str(state))
        assert first.returncode == 0, first.stderr
        seen = [json.loads(line) for line in first.stdout.splitlines()]
        assert seen and seen[-1]["type"] == "block_stored"
        saved = json.loads(state.read_text())
        assert saved["after_sequence"] == seen[-1]["sequence"]

        client.step("p", [allocate("ev-2", list(range(600, 608)), 8)], sid, fence)
        second = run(server, "events", "--pool", "p", "--json", "--seconds", "1", "--state-file", str(state))
        again = [json.loads(line) for line in second.stdout.splitlines()]
        assert again and again[0]["sequence"] > seen[-1]["sequence"]
        assert not again[0]["gap"] and not again[0]["reset"]
        assert [e["sequence"] for e in again] == sorted({e["sequence"] for e in again})

        # more events than the buffer keeps: resuming from the start misses some
        for i in range(EVENT_BUFFER):
            client.step("p", [allocate(f"ev-g{i}", list(range(1000 + 8 * i, 1008 + 8 * i)), 8)], sid, fence)
        gapped = run(server, "events", "--pool", "p", "--seconds", "1", "--after", "1", "--fence",
                     saved["fence"])  # fmt: skip
        assert gapped.returncode == 0, gapped.stderr
        assert gapped.stdout.splitlines()[0].startswith("GAP: events 2..")

        other = run(server, "events", "--pool", "p", "--seconds", "1", "--after", "1", "--fence", "other:7")
        assert other.stdout.splitlines()[0].startswith("RESET: another history")
        assert "resume with --after" in other.stderr
    finally:
        client.detach(sid, fence)


def test_events_follow_resumes_across_a_server_restart(tmp_path: Path) -> None:
    """`kvcoord events --follow` outlives a SIGKILLed and restarted server: it says the
    stream was lost, resumes after the last event it read (the journaled pool's history
    goes on: the next event, no gap, no reset, the new instance's fence), and SIGINT
    stops it cleanly (exit 130, Ctrl-C's status) with the state file at the last event."""
    srv = DurableServer(
        tmp_path,
        small_pool(64).replace(
            "enable_caching = true", "enable_caching = true\nenable_kv_cache_events = true"
        ),
    )
    srv.start()
    state = tmp_path / "follow.json"
    e = env()
    e.update(KVCOORD_TARGET=srv.address)
    proc = started_for_sigint(
        [sys.executable, "-m", "kvcoord.client.cli", "events", "--pool", "p", "--follow", "--json",
         "--state-file", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
    )  # fmt: skip
    lines: list[dict[str, Any]] = []
    received: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: [received.put(line) for line in proc.stdout], daemon=True)  # type: ignore[union-attr]
    reader.start()

    def read_until(pred: Any) -> dict[str, Any]:
        """The next event printed that ``pred`` accepts (a bound on a hang per line,
        generous: a restart and the CLI's resume took 45-75 s at load 30 on 2 cores)."""
        for _ in range(50):
            try:
                line = received.get(timeout=180)
            except queue.Empty:
                raise AssertionError(f"no event line within 180 s after {lines}") from None
            lines.append(json.loads(line))
            if pred(lines[-1]):
                return lines[-1]
        raise AssertionError(lines)

    def store_blocks(rid: str, tokens: list[int]) -> pb.Fence:
        """One BlockStored event: a worker computes ``tokens``, frees them (they stay
        cached) and detaches. A session left to its lease would drop them from the cache
        when the lease ran out (BlockRemoved: abandoned requests), which a loaded machine
        reached mid-test (2 cores at load 30: the CLI's start alone took 20-35 s)."""
        with KVCoordClient(srv.address) as c:
            sid, fence = attach(c, "p")
            c.step("p", [allocate(rid, tokens, len(tokens)), pb.Operation(free=pb.FreeOp(request_id=rid))],
                   sid, fence)  # fmt: skip
            c.detach(sid, fence)
        return fence

    try:
        store_blocks("before", list(range(8)))
        first = read_until(lambda ev: ev["type"] == "block_stored")
        srv.kill()
        srv.start()
        fence = store_blocks("after", list(range(900, 908)))
        new_fence = f"{fence.instance_id}:{fence.incarnation}"
        resumed = read_until(lambda ev: ev["sequence"] > first["sequence"])
        assert (resumed["sequence"], resumed["type"]) == (first["sequence"] + 1, "block_stored")
        assert (resumed["fence"], resumed["gap"], resumed["reset"]) == (new_fence, False, False)
        assert resumed["fence"] != first["fence"]
        deadline = time.monotonic() + 120  # written right after the line is printed; a bound on a hang
        while not (state.exists() and json.loads(state.read_text())["after_sequence"] == resumed["sequence"]):
            assert time.monotonic() < deadline, f"the state file never reached {resumed['sequence']}"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert "kvcoord: stream lost" in err and "kvcoord: stream resumed" in err, err
        assert "Traceback" not in err
        saved = json.loads(state.read_text())
        assert (saved["after_sequence"], saved["fence"]) == (lines[-1]["sequence"], new_fence)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        srv.stop()


def test_events_follow_stops_on_sigint_wherever_it_waits(tmp_path: Path) -> None:
    """Ctrl-C ends `kvcoord events --follow` with status 130 and its resume line (the
    last event read), wherever it waits: reading a live stream; reading from a server
    held with SIGSTOP (a restart in progress: connected, nothing answers); and, the
    server SIGKILLed, resuming every second (signalled at staggered moments of the
    sleep and the resume calls). Five real CLI processes; the waits are bounds on a hang."""
    srv = DurableServer(
        tmp_path,
        small_pool(64).replace(
            "enable_caching = true", "enable_caching = true\nenable_kv_cache_events = true"
        ),
    )
    srv.start()
    e = env()
    e.update(KVCOORD_TARGET=srv.address)
    names = ["live", "paused", "lost-0", "lost-1", "lost-2"]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def text(name: str, kind: str) -> str:
        return (tmp_path / f"{name}.{kind}").read_text()

    def wait_for(name: str, kind: str, needle: str) -> None:
        deadline = time.monotonic() + 180  # a loaded machine started the CLI in 20-35 s
        while needle not in text(name, kind):
            assert procs[name].poll() is None, (name, procs[name].returncode, text(name, "err"))
            assert time.monotonic() < deadline, (name, needle, text(name, kind))
            time.sleep(0.05)

    def interrupt(name: str, sequence: int) -> None:
        procs[name].send_signal(signal.SIGINT)
        try:
            status = procs[name].wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name}: SIGINT did not end it: {text(name, 'err')}") from None
        err = text(name, "err")
        assert status == 130, (name, status, err)
        assert "Traceback" not in err, (name, err)
        assert f"1 event(s); resume with --after {sequence} --fence" in err, (name, err)

    try:
        for name in names:  # stdout and stderr to files: no pipe fills up unread
            with open(tmp_path / f"{name}.out", "wb") as out, open(tmp_path / f"{name}.err", "wb") as err:
                procs[name] = started_for_sigint(
                    [sys.executable, "-m", "kvcoord.client.cli", "events", "--pool", "p", "--follow"],
                    stdout=out, stderr=err, env=e,
                )  # fmt: skip
        with KVCoordClient(srv.address) as c:
            sid, fence = attach(c, "p")
            c.step("p", [allocate("sig", list(range(8)), 8), pb.Operation(free=pb.FreeOp(request_id="sig"))],
                   sid, fence)  # fmt: skip
            c.detach(sid, fence)
        for name in names:
            wait_for(name, "out", "block_stored")
        sequence = int(text("live", "out").split()[0])
        interrupt("live", sequence)
        with srv.paused():
            interrupt("paused", sequence)
        srv.kill()
        for name in names[2:]:
            wait_for(name, "err", "kvcoord: stream lost")
        for i, name in enumerate(names[2:]):
            time.sleep(0.35 * i)  # within the 1 s between resumes: the sleep, then a resume call
            interrupt(name, sequence)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if srv.proc is not None and srv.proc.poll() is None:
            srv.kill()


def test_score_a_prompt_file(server: DurableServer, client: KVCoordClient, tmp_path: Path) -> None:
    """`kvcoord score FILE` gives each pool's hit for the prompt as ScorePools answers it
    through the client's router; JSON and text prompt files are the same prompt."""
    tokens = list(range(700, 730))
    sid, fence = attach(client, "p")
    # computed and finished: freed (a detach holding it would drop its blocks' hashes)
    client.step(
        "p",
        [allocate("sc-1", tokens, len(tokens)), pb.Operation(free=pb.FreeOp(request_id="sc-1"))],
        sid,
        fence,
    )
    client.detach(sid, fence)
    reference = PoolRouter(client).score(tokens)
    expected = {s.pool: s.hit_tokens for s in reference.scores}
    assert expected["p"] > 0
    as_json = tmp_path / "prompt.json"
    as_json.write_text(json.dumps({"token_ids": tokens}))
    as_text = tmp_path / "prompt.txt"
    as_text.write_text("\n".join(" ".join(map(str, tokens[i : i + 7])) for i in range(0, len(tokens), 7)))
    for path in (as_json, as_text):
        proc = run(server, "score", str(path), "--json")
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["num_tokens"] == len(tokens)
        assert {s["pool"]: s["hit_tokens"] for s in got["scores"]} == expected
    text = run(server, "score", str(as_text))
    assert any(line.split()[:2] == ["p", "*"] for line in text.stdout.splitlines()), text.stdout
    bad = tmp_path / "bad.txt"
    bad.write_text("hello world")
    proc = run(server, "score", str(bad))
    assert proc.returncode == cli_common.EXIT_USAGE
    assert "neither JSON nor" in one_line_error(proc)


def test_score_a_lora_prompt_in_a_033_pool(
    server: DurableServer, client: KVCoordClient, tmp_path: Path
) -> None:
    """`kvcoord score` hashes a LoRA prompt for a vllm-0.33 pool by 0.33's rules (the
    adapter's path is part of the key): its hit there is FindLongestCacheHit's with
    those hashes; without the path the prompt cannot be hashed (usage error)."""
    from kvcoord.client.hashing import block_hasher, none_hash

    cfg = client.get_pool("p").pool.config
    cfg.profile = "vllm-0.33"
    client.create_pool("p33", cfg)
    tokens = list(range(300, 331))
    hashes = block_hasher("vllm-0.33", "sha256_cbor", 4, none_hash("sha256_cbor", "0", profile="vllm-0.33"),
                          lora_name="ad", lora_path="/loras/ad").extend(tokens)  # fmt: skip
    sid, fence = attach(client, "p33", profile="vllm-0.33")
    sync = pb.RequestSync(request_id="l-1", append_token_ids=tokens, append_block_hashes=hashes, new_request=True,
                          lora=pb.LoRA(adapter_id=1, name="ad"))  # fmt: skip
    client.step(
        "p33", [pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=len(tokens)))], sid, fence
    )
    expected = client.find_longest_cache_hit("p33", hashes, len(tokens)).hit.num_tokens
    assert expected > 0
    prompt = tmp_path / "lora.json"
    prompt.write_text(json.dumps({"token_ids": tokens, "lora_name": "ad", "lora_path": "/loras/ad"}))
    proc = run(server, "score", str(prompt), "--pool", "p33", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [(s["pool"], s["hit_tokens"]) for s in json.loads(proc.stdout)["scores"]] == [("p33", expected)]
    prompt.write_text(json.dumps({"token_ids": tokens, "lora_name": "ad"}))
    proc = run(server, "score", str(prompt), "--pool", "p33")
    assert proc.returncode == cli_common.EXIT_USAGE
    assert "lora_path" in one_line_error(proc)


def test_serve_cannot_bind_its_port(tmp_path: Path) -> None:
    """`kvcoord serve` on a port in use (gRPC or metrics) exits 3 with one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = f"127.0.0.1:{s.getsockname()[1]}"
        for flags in (
            ["--listen", busy, "--metrics-listen", ""],
            ["--listen", "127.0.0.1:0", "--metrics-listen", busy],
        ):
            proc = kvcoord("serve", *flags, KVCOORD_DATA_DIR=str(tmp_path / "data"))
            assert proc.returncode == 3, proc.stdout + proc.stderr
            assert "Traceback" not in proc.stderr, proc.stderr
            last = proc.stderr.strip().splitlines()[-1]  # a log event (service/logs.py): one line
            assert "CRITICAL" in last and "kvcoord: cannot start: cannot " in last and busy in last, (
                proc.stderr
            )


def _refused_beside(first: DurableServer, args: list[str], **extra_env: str) -> str:
    """The last line a second `kvcoord serve` (``args``) printed as it exited 3 while
    ``first`` serves (failing the test when it started instead)."""
    second = subprocess.Popen(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(env(), **extra_env),
    )  # fmt: skip
    try:
        _, err = second.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        second.kill()
        _, err = second.communicate()
        pytest.fail(f"a second server started beside the first ({first.address}, {first.data_dir}): {err}")
    assert second.returncode == 3, err
    assert first.proc is not None and first.proc.poll() is None
    return err.strip().splitlines()[-1]


def test_serve_refuses_a_port_another_kvcoord_serves(tmp_path: Path) -> None:
    """A second `kvcoord serve` on the port a running one serves exits 3 with one line,
    and the first goes on serving alone. (gRPC binds with SO_REUSEPORT unless told not
    to: both listened, the kernel split new connections between two servers with
    different pools and sessions, and a client that reconnected found its pool gone.)"""
    first = DurableServer(tmp_path, pools_toml=small_pool(16))
    first.start()
    try:
        last = _refused_beside(
            first,
            ["--listen", first.address, "--metrics-listen", ""],
            KVCOORD_DATA_DIR=str(tmp_path / "second"),
        )
        assert "kvcoord: cannot start: cannot listen on " in last and first.address in last, last
        # every new connection reaches the first server: its pool is there each time
        for _ in range(8):
            with KVCoordClient(first.address, timeout=10) as c:
                assert [p.name for p in c.list_pools().pools] == ["p"]
    finally:
        first.stop()


def test_serve_refuses_a_data_directory_another_kvcoord_serves(tmp_path: Path) -> None:
    """A second `kvcoord serve` on the data directory a running one serves (another
    port) exits 3 with one line naming the first's pid, reading nothing there; the
    first serves on; once it is SIGKILLed, a server starts on the directory at once
    with its state. (Both ran before: each recovered the journal, handed out blocks
    from its own copy of the pools and appended its own records to the one journal.)"""
    first = DurableServer(tmp_path, pools_toml=small_pool(16))
    first.start()
    try:
        with KVCoordClient(first.address, timeout=10) as c:
            sid, fence = attach(c, "p")
            c.step("p", [allocate("held", list(range(8)), 8)], sid, fence)
        last = _refused_beside(first, ["--config", str(first.config), "--listen", f"127.0.0.1:{free_port()}"])
        assert first.proc is not None
        assert (
            f"kvcoord: cannot start: data directory {first.data_dir} is in use by another kvcoord server"
            in last
        )
        assert f"(pid {first.proc.pid} on " in last, last
        first.kill()  # SIGKILL: the kernel gives the lock back with the process
        first.start()  # at once, on the same directory: its state recovered
        with KVCoordClient(first.address, timeout=10) as c:
            assert [r.request_id for r in c.inspect_pool("p", all_requests=True).requests] == ["held"]
    finally:
        first.stop()


def test_version_and_completion() -> None:
    """`kvcoord --version` prints the version; click's completion script is produced."""
    proc = kvcoord("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("kvcoord, version ")
    comp = kvcoord(_KVCOORD_COMPLETE="bash_source")
    assert comp.returncode == 0 and "_KVCOORD_COMPLETE" in comp.stdout and "complete " in comp.stdout


# -- formatting (CliRunner) -----------------------------------------------------------


def _stats(**kw: Any) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(**kw)


def test_status_table_formatting() -> None:
    info = pb.PoolInfo(
        name="alpha", coordinator="hybrid", config=pb.PoolConfig(groups=[pb.KVCacheGroupSpec()] * 2)
    )
    stats = _stats(
        num_free_blocks=25,
        num_total_blocks=100,
        usage=0.75,
        num_requests=3,
        num_sessions=2,
        prefix_cache_stats=pb.PrefixCacheStats(queries=200, hits=50),
    )
    row = cli_pools.pool_status(info, stats)
    assert (row["blocks_used"], row["hit_rate"]) == (75, 0.25)
    fresh = cli_pools.pool_status(
        pb.PoolInfo(name="b", coordinator="unitary"), _stats(num_total_blocks=9, num_free_blocks=9)
    )
    assert fresh["hit_rate"] is None
    hidden = {"pool": "c", "coordinator": "hybrid", "groups": 1, "unreadable": "PERMISSION_DENIED"}
    lines = cli_pools.status_table([row, fresh, hidden]).splitlines()
    assert lines[3].split() == ["c", "hybrid", "(1", "group)", "?", "?", "?", "?", "?"]
    assert lines[4].startswith("? no observe role")
    assert lines[1].split() == ["alpha", "hybrid", "(2", "groups)", "75/100", "75.0%", "25.0%", "3", "2"]
    assert lines[2].split() == ["b", "unitary", "(0", "groups)", "0/9", "0.0%", "-", "0", "0"]


def test_event_lines_show_gaps_and_resets() -> None:
    fence = pb.Fence(instance_id="i", incarnation=3)
    stored = pb.KVEvent(block_stored=pb.BlockStored(block_hashes=[b"\x01" * 8], token_ids=[1, 2, 3, 4]))
    gap = pb.WatchEventsResponse(sequence=9, event=stored, gap=True, fence=fence)
    assert cli_observe.event_lines(gap, 4)[0] == "GAP: events 5..8 are no longer buffered: resynchronise"
    reset = pb.WatchEventsResponse(sequence=1, event=pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()),
                                   reset=True, fence=fence)  # fmt: skip
    lines = cli_observe.event_lines(reset, 40)
    assert lines[0].startswith("RESET: another history (i:3)") and lines[-1].split() == [
        "1",
        "all_blocks_cleared",
    ]
    plain = cli_observe.event_lines(pb.WatchEventsResponse(sequence=5, event=stored, fence=fence), 4)
    assert plain == ["       5  block_stored       1 block(s) 0101010101010101 (4 tokens)"]


def test_prompt_files_and_usage_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    for body in ("[1, 2, 3]", '{"token_ids": [1, 2, 3], "lora_name": "x"}', "1 2\n3", "1,2,3"):
        path = tmp_path / "p"
        path.write_text(body)
        tokens, _extra = cli_observe.read_prompt(str(path))
        assert tokens == [1, 2, 3], body
    for body, said in (("[]", "no tokens"), ('["a"]', "JSON list of token ids"), ("[-1]", "negative")):
        path = tmp_path / "q"
        path.write_text(body)
        result = runner.invoke(client_cli.cli, ["score", str(path), "--target", "127.0.0.1:1"])
        assert result.exit_code == cli_common.EXIT_USAGE and said in result.output, result.output
    result = runner.invoke(client_cli.cli, ["events", "--pool", "p", "--fence", "nonsense"])
    assert result.exit_code == 2 and "INSTANCE:INCARNATION" in result.output
    result = runner.invoke(client_cli.cli, ["status", "--tls-ca", str(ROOT / "no-such.pem")])
    assert result.exit_code == cli_common.EXIT_USAGE and "no-such.pem" in result.output


def test_client_commands_need_no_server_modules() -> None:
    """The operator commands import only the client distribution (client, wire, engine)."""
    code = (
        "import sys, kvcoord.client.cli as c; c.main(['--help']); "
        "bad = [m for m in sys.modules if m.startswith('kvcoord.service')]; "
        "sys.exit(1 if bad else 0)"
    )
    e = env()
    e["PYTHONPATH"] = str(ROOT / "client")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_command_given_a_cluster_name_is_refused_by_a_server_of_none(
    server: DurableServer, client: KVCoordClient
) -> None:
    """`--cluster prod` (or KVCOORD_CLUSTER): every call names a replica of cluster prod,
    so a server of no cluster at --target refuses it (server unreachable, exit 6, one
    line naming the replica meant) and nothing is deleted; a name that cannot travel in
    metadata is a usage error (exit 2)."""
    made = run(server, "pools", "create", "cli-named", "--num-blocks", "33", "--block-size", "8")
    assert made.returncode == 0, made.stderr
    refused = run(server, "pools", "delete", "cli-named", "--yes", "--cluster", "prod")
    assert refused.returncode == cli_common.EXIT_UNREACHABLE, refused.stderr
    assert "'prod/*'" in one_line_error(refused)
    by_env = kvcoord("status", KVCOORD_TARGET=server.address, KVCOORD_TOKEN=TOKEN, KVCOORD_CLUSTER="prod")
    assert by_env.returncode == cli_common.EXIT_UNREACHABLE, by_env.stderr
    assert "cli-named" in [p.name for p in client.list_pools().pools]
    bad = run(server, "status", "--cluster", "a b")
    assert bad.returncode == cli_common.EXIT_USAGE and "cluster" in one_line_error(bad)
