"""Bearer tokens are secrets: no log line, status message or printed setting repeats one."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from kvcoord.client import NO_RETRY, KVCoordClient, PermissionDeniedError
from kvcoord.client.testing import start_server
from kvcoord.client.vllm import Settings
from kvcoord.service.config import load_config
from kvcoord.service.testing import InProcessServer

ROOT = Path(__file__).resolve().parents[2]
GOOD = "good-token-6f1d0c"
WRONG = "wrong-token-9a7e42"


def test_a_wrong_token_appears_in_no_log_and_no_status_message(
    make_server: Callable[..., InProcessServer],
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A call with a wrong token: UNAUTHENTICATED, and neither token is in the status
    message, the client's exception, any Python log record (DEBUG and up) or the
    process's stdout/stderr (where gRPC's core logs)."""
    caplog.set_level(logging.DEBUG)
    server = make_server(auth_tokens=(GOOD,))
    with KVCoordClient(server.address, token=WRONG, timeout=5, retry=NO_RETRY) as c:
        with pytest.raises(PermissionDeniedError) as info:
            c.list_pools()
        with pytest.raises(PermissionDeniedError):
            list(c.watch_events("p", 0, timeout=5))
    err = info.value
    assert err.code.name == "UNAUTHENTICATED"
    out, errout = capfd.readouterr()
    for text in (str(err), repr(err), err.message, caplog.text, out, errout):
        assert WRONG not in text and GOOD not in text
    assert "bearer token" in err.message  # the message still says what to change


def test_settings_never_print_tokens() -> None:
    """The loaded settings' repr (what a debug print or log would show) omits auth_tokens."""
    cfg = load_config(env={"KVCOORD_AUTH_TOKENS": f"{GOOD},{WRONG}"})
    assert cfg.server.auth_tokens == (GOOD, WRONG)
    assert GOOD not in repr(cfg) and WRONG not in repr(cfg.server)


def test_vllm_adapter_settings_never_print_the_token() -> None:
    """kvcoord.client.vllm.Settings (KVCOORD_TOKEN) keeps the token but its repr and str,
    what a debug print or a log of the settings would show, omit it."""
    settings = Settings.from_env({"KVCOORD_TARGET": "kv:50051", "KVCOORD_TOKEN": GOOD})
    assert settings.token == GOOD
    assert GOOD not in repr(settings) and GOOD not in str(settings) and GOOD not in f"{settings!r}"
    assert "kv:50051" in repr(settings)


def test_server_process_log_has_no_token() -> None:
    """`kvcoord serve` at DEBUG, with tokens from the environment, refusing a wrong token:
    its whole log holds neither token."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}",
        KVCOORD_AUTH_TOKENS=GOOD,
        KVCOORD_LOG_LEVEL="DEBUG",
    )
    server = start_server(None, env=env)
    try:
        with KVCoordClient(server.address, token=GOOD, timeout=10) as c:
            assert [p.name for p in c.list_pools().pools] == ["default"]
        with KVCoordClient(server.address, token=WRONG, timeout=10, retry=NO_RETRY) as c:
            with pytest.raises(PermissionDeniedError) as info:
                c.get_stats("default")
        assert WRONG not in str(info.value)
    finally:
        assert server.stop() == 0
    log = server.log()
    assert "plaintext: bearer tokens cross the network unencrypted" in log
    assert GOOD not in log and WRONG not in log
