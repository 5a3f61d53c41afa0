"""The server's logs as a log pipeline meets them: JSON lines (KVCOORD_LOG_FORMAT=json)
or readable text, the ids as fields, the optional access log, and no token or prompt."""

from __future__ import annotations

import io
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import allocate, attach
from kvcoord.client import NO_RETRY, KVCoordClient, PermissionDeniedError
from kvcoord.client.testing import start_server
from kvcoord.service.config import ConfigFileError, load_config
from kvcoord.service.logs import configure, ids
from kvcoord.v1 import allocator_pb2 as pb
from support import POOL_TOML

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tenant-token-5c0ffee1"
WRONG = "wrong-token-77aa01"
#: prompt tokens no log line may carry (no other number in a log looks like them)
PROMPT = [918273645 + i for i in range(12)]

CONFIG = f"""
[server]
access_log = true
session_lease_seconds = 2.5
journal_stall_seconds = 1.0

[tenants.team]
tokens = ["{TOKEN}"]
grants = [{{ pools = ["p"], roles = ["administer", "use", "observe"] }}]
{POOL_TOML}
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT / 'client'}:{ROOT / 'server'}"
    env.update(extra)
    return env


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object (fails on any line that is not one)."""
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"not a JSON line: {line!r}")
    return out


def test_json_logs_carry_ids_and_the_access_log_but_no_token_or_prompt() -> None:
    """`kvcoord serve` with KVCOORD_LOG_FORMAT=json and access_log on, driven by a
    tenant with a token (a session, a prompt allocated and freed, a wrong token, a
    session left to expire): every line is a JSON object; the pool, session, tenant and
    request are fields of the lines about them; each RPC has an access line with its
    status and duration; the token and the prompt's tokens appear nowhere."""
    server = start_server(CONFIG, env=_env(KVCOORD_LOG_FORMAT="json", KVCOORD_LOG_LEVEL="DEBUG"))
    try:
        with KVCoordClient(server.address, token=TOKEN, timeout=10) as c:
            sid, fence = attach(c, "p")
            assert not c.allocate(
                "p", allocate("req-a", PROMPT, len(PROMPT)).allocate, sid, fence
            ).result.refused
            c.free("p", ["req-a"], session_id=sid, fence=fence)
            c.step("p", [pb.Operation(free=pb.FreeOp(request_id="req-a"))], sid, fence)
            gone, _ = attach(c, "p", lease_seconds=2.5)
        with KVCoordClient(server.address, token=WRONG, timeout=10, retry=NO_RETRY) as c:
            with pytest.raises(PermissionDeniedError):
                c.get_stats("p")
        deadline = time.monotonic() + 20
        while "expired" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        assert server.stop() == 0
    text = server.log()
    lines = _json_lines(text)
    assert all({"timestamp", "level", "logger", "event"} <= set(line) for line in lines)
    # the ids as fields
    created = [line for line in lines if line["event"].startswith("created pool p ")]
    assert created and created[0]["pool"] == "p"
    expired = [line for line in lines if "expired" in line["event"]]
    assert expired and expired[0]["session"] in (sid, gone) and expired[0]["pool"] == "p"
    assert expired[0]["tenant"] == "team"
    serving = [line for line in lines if line["event"].startswith("kvcoord serving gRPC on")]
    assert serving and serving[0]["grpc"] == [server.address] and serving[0]["pools"] == ["p"]
    # the access log: one line per RPC
    access = [line for line in lines if line["logger"] == "kvcoord.access"]
    by_rpc = {line["rpc"].rsplit("/", 1)[1]: line for line in access}
    alloc = by_rpc["Allocate"]
    assert (alloc["tenant"], alloc["pool"], alloc["session"], alloc["request"], alloc["status"]) == (
        "team", "p", sid, "req-a", "OK",
    )  # fmt: skip
    assert by_rpc["Free"]["request"] == ["req-a"]
    # (a Step's handler is given its bytes and parses them itself: wire_slices.py)
    assert (by_rpc["Step"]["pool"], by_rpc["Step"]["session"]) == ("p", sid)
    assert isinstance(alloc["duration_ms"], float) and alloc["duration_ms"] >= 0
    refused = by_rpc["GetStats"]
    assert (refused["status"], refused["tenant"]) == ("UNAUTHENTICATED", "(not authenticated)")
    # nothing secret
    assert TOKEN not in text and WRONG not in text
    assert str(PROMPT[0]) not in text and str(PROMPT[-1]) not in text


def test_text_logs_by_default_and_no_access_log_unless_asked() -> None:
    """Without KVCOORD_LOG_FORMAT the lines are readable text (`time LEVEL logger:
    message key=value`), and with access_log off no RPC is logged."""
    env = _env()
    env.pop("KVCOORD_LOG_FORMAT", None)
    server = start_server(POOL_TOML, env=env)
    try:
        with KVCoordClient(server.address, timeout=10) as c:
            assert [p.name for p in c.list_pools().pools] == ["p"]
    finally:
        assert server.stop() == 0
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert lines and not any(line.lstrip().startswith("{") for line in lines)
    created = [line for line in lines if "created pool p " in line]
    assert created and " INFO kvcoord.service.registry: created pool p " in created[0]
    assert created[0].split("  ", 1)[1].startswith("pool=p ")
    assert "kvcoord.access" not in server.log() and "ListPools" not in server.log()


def test_configure_renders_ids_as_fields_and_blanks_secret_fields() -> None:
    """logs.configure: an ``extra=ids(...)`` call becomes fields of its JSON line; a
    field whose name says it holds a token or a prompt is never written."""
    out = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure("INFO", "json", stream=out)
        logging.getLogger("kvcoord.test").info(
            "session %s freed", "s-1", extra=ids(pool="p", session="s-1", token="tok-xyz", prompt=[5, 6])
        )
        logging.getLogger("kvcoord.test").debug("below the level")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    (line,) = _json_lines(out.getvalue())
    assert (line["event"], line["pool"], line["session"], line["level"]) == (
        "session s-1 freed",
        "p",
        "s-1",
        "info",
    )
    assert line["token"] == line["prompt"] == "[not logged]"
    assert "tok-xyz" not in out.getvalue()


def test_log_format_is_checked_and_taken_from_the_environment() -> None:
    assert load_config(env={"KVCOORD_LOG_FORMAT": "json"}).server.log_format == "json"
    assert load_config(env={}).server.log_format == "text"
    with pytest.raises(ConfigFileError, match="log_format"):
        load_config(env={"KVCOORD_LOG_FORMAT": "xml"})


def test_startup_facts_are_logged_whatever_the_level() -> None:
    """At log_level WARNING the INFO lines are gone, but the lifecycle events (where the
    server listens, that it stopped) are still there: client.testing.start_server finds
    the bound port in them."""
    server = start_server('[server]\nlog_level = "WARNING"\n' + POOL_TOML, metrics=True, env=_env())
    try:
        with KVCoordClient(server.address, timeout=10) as c:
            assert [p.name for p in c.list_pools().pools] == ["p"]
    finally:
        assert server.stop() == 0
    log = server.log()
    assert server.metrics_address and f"kvcoord metrics on http://{server.metrics_address}/metrics" in log
    assert "created pool p " not in log  # an INFO line of another logger
    assert log.rstrip().endswith("kvcoord stopped")
