"""TLS and mutual TLS over real gRPC and HTTPS, with certificates generated at test time
(tests/certs.py): who gets in, who is refused, and that tokens still apply on top."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from certs import CertFiles
from conftest import POOL_TOML
from kvcoord.client import (
    NO_RETRY,
    AsyncKVCoordClient,
    KVCoordClient,
    PermissionDeniedError,
    RemoteKVCacheManager,
    TLSOptions,
    UnavailableError,
    cli,
)
from kvcoord.client.testing import start_server
from kvcoord.conformance import cli as conformance_cli
from kvcoord.service.metrics import Metrics
from kvcoord.service.server import start_server as start_grpc_server
from kvcoord.service.testing import InProcessServer
from kvcoord.service.tls import TLSFiles

ROOT = Path(__file__).resolve().parents[2]
TRACE = sorted((ROOT / "tests" / "conformance" / "data").glob("*.jsonl"))[0]

Make = Callable[..., InProcessServer]


def server_tls(certs: CertFiles, *, mutual: bool) -> TLSFiles:
    return TLSFiles(str(certs.server_cert), str(certs.server_key), str(certs.ca) if mutual else "")


def client_tls(certs: CertFiles, *, cert: bool = True, **kw: str) -> TLSOptions:
    if cert:
        return TLSOptions(certs.ca, certs.client_cert, certs.client_key, **kw)
    return TLSOptions(certs.ca, **kw)


def refused(address: str, tls: TLSOptions | None, token: str | None = None) -> grpc.StatusCode:
    """The status a call gets (no retries); fails the test if the call succeeds."""
    with KVCoordClient(address, tls=tls, token=token, timeout=5, retry=NO_RETRY) as c:
        with pytest.raises((UnavailableError, PermissionDeniedError)) as info:
            c.list_pools()
    code: grpc.StatusCode = info.value.code
    return code


class Req:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.all_token_ids = tokens
        self.num_computed_tokens = 0


def test_tls_client_works_and_the_manager_inherits_it(make_server: Make, certs: CertFiles) -> None:
    """Server TLS, client verifying with the test CA: health, pools and RemoteKVCacheManager work."""
    server = make_server(tls=server_tls(certs, mutual=False))
    with KVCoordClient(server.address, tls=client_tls(certs, cert=False), timeout=5) as c:
        assert c.health() == "SERVING"
        assert [p.name for p in c.list_pools().pools] == ["p"]
        kv = RemoteKVCacheManager(c, "p", hash_seed="0")
        r = Req("r1", list(range(10)))
        hit, n = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, 10 - n, n, hit) is not None
        kv.free(r)
        kv.close()


def test_plaintext_client_is_refused_by_a_tls_server(make_server: Make, certs: CertFiles) -> None:
    """A plaintext channel to a TLS listener fails the handshake: UNAVAILABLE."""
    server = make_server(tls=server_tls(certs, mutual=False))
    assert refused(server.address, None) == grpc.StatusCode.UNAVAILABLE


def test_client_verifies_the_server(make_server: Make, certs: CertFiles) -> None:
    """A client that does not trust the server's CA, or expects another name, is refused;
    server_name_override reaches the channel."""
    server = make_server(tls=server_tls(certs, mutual=False))
    assert refused(server.address, TLSOptions(ca_file=certs.other_ca)) == grpc.StatusCode.UNAVAILABLE
    wrong_name = client_tls(certs, cert=False, server_name_override="kvcoord.invalid")
    assert refused(server.address, wrong_name) == grpc.StatusCode.UNAVAILABLE
    by_name = client_tls(certs, cert=False, server_name_override="localhost")
    with KVCoordClient(server.address, tls=by_name, timeout=5) as c:
        assert c.health() == "SERVING"


def test_mutual_tls_requires_a_certificate_from_the_client_ca(make_server: Make, certs: CertFiles) -> None:
    """With client_ca_file: a client certificate of that CA gets in; none, or one of
    another CA, is refused with UNAVAILABLE."""
    server = make_server(tls=server_tls(certs, mutual=True))
    with KVCoordClient(server.address, tls=client_tls(certs), timeout=5) as c:
        assert [p.name for p in c.list_pools().pools] == ["p"]
    assert refused(server.address, client_tls(certs, cert=False)) == grpc.StatusCode.UNAVAILABLE
    stranger = TLSOptions(certs.ca, certs.other_client_cert, certs.other_client_key)
    assert refused(server.address, stranger) == grpc.StatusCode.UNAVAILABLE
    assert refused(server.address, None) == grpc.StatusCode.UNAVAILABLE


def test_async_client_over_mutual_tls(make_server: Make, certs: CertFiles) -> None:
    """AsyncKVCoordClient takes the same TLSOptions."""
    server = make_server(tls=server_tls(certs, mutual=True))

    async def main() -> list[str]:
        async with AsyncKVCoordClient(server.address, tls=client_tls(certs), timeout=5) as c:
            return [p.name for p in (await c.list_pools()).pools]

    assert asyncio.run(main()) == ["p"]


def test_bearer_tokens_still_apply_over_tls(make_server: Make, certs: CertFiles) -> None:
    """mTLS plus auth_tokens: the right token works; a wrong or missing one is UNAUTHENTICATED."""
    server = make_server(tls=server_tls(certs, mutual=True), auth_tokens=("s3cret-token",))
    with KVCoordClient(server.address, tls=client_tls(certs), token="s3cret-token", timeout=5) as c:
        assert [p.name for p in c.list_pools().pools] == ["p"]
    tls = client_tls(certs)
    assert refused(server.address, tls, token="not-the-token") == grpc.StatusCode.UNAUTHENTICATED
    assert refused(server.address, tls) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("mutual", [False, True])
def test_identities_without_a_client_ca_warn_at_start(
    make_server: Make, certs: CertFiles, caplog: pytest.LogCaptureFixture, mutual: bool
) -> None:
    """Tenant identities with TLS but no client_ca_file can never match (no client
    certificate is asked for): the server says so at start; with a client CA it does not,
    and the identity then names the tenant."""
    caplog.set_level(logging.WARNING)
    tenant = '[tenants.w]\nidentities = ["cn:worker-1"]\ngrants = [{ pools = ["*"], roles = ["observe"] }]\n'
    server = make_server(tenant + POOL_TOML, tls=server_tls(certs, mutual=mutual))
    warned = [r.getMessage() for r in caplog.records if "can never name a caller" in r.getMessage()]
    if mutual:
        assert warned == []
        with KVCoordClient(server.address, tls=client_tls(certs), timeout=5) as c:
            assert [p.name for p in c.list_pools().pools] == ["p"]
    else:
        assert len(warned) == 1 and "tenants w have mTLS identities" in warned[0]
        assert refused(server.address, client_tls(certs, cert=False)) == grpc.StatusCode.UNAUTHENTICATED


def test_unix_socket_listener_stays_plaintext(tmp_path: Path, certs: CertFiles) -> None:
    """With [server.tls] set, TCP listeners speak TLS while a unix socket stays plaintext."""
    from kvcoord.service.config import parse_config

    sock = tmp_path / "kvcoord.sock"
    cfg = parse_config(
        f'[server]\nlisten = ["127.0.0.1:0", "unix:{sock}"]\nmetrics_listen = ""\n'
        f'[server.tls]\ncert_file = "{certs.server_cert}"\nkey_file = "{certs.server_key}"\n' + POOL_TOML
    )

    async def main() -> list[str]:
        running = await start_grpc_server(cfg)
        try:
            async with AsyncKVCoordClient(running.addresses[0], timeout=5, retry=NO_RETRY) as tcp:
                with pytest.raises(UnavailableError):
                    await tcp.list_pools()  # plaintext to the TLS port
            async with AsyncKVCoordClient(f"unix:{sock}", timeout=5) as plain:
                return [p.name for p in (await plain.list_pools()).pools]
        finally:
            await running.stop(0.5)

    assert asyncio.run(main()) == ["p"]


def test_cli_conformance_and_health_over_mutual_tls(
    make_server: Make, certs: CertFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvcoord conformance --target ... --tls-ca/--tls-cert/--tls-key` passes a trace over
    mTLS, and `kvcoord health` with the same flags reports SERVING; without them both fail."""
    server = make_server(tls=server_tls(certs, mutual=True))
    flags = [
        "--tls-ca",
        str(certs.ca),
        "--tls-cert",
        str(certs.client_cert),
        "--tls-key",
        str(certs.client_key),
    ]
    assert conformance_cli.main(["--target", server.address, *flags, str(TRACE)]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert cli.main(["health", "--target", server.address, *flags]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert cli.main(["status", "--target", server.address, *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == server.address
    assert cli.main(["status", "--target", server.address, "--timeout", "2"]) == 6  # plaintext: refused
    assert "server unreachable" in capsys.readouterr().err
    assert cli.main(["health", "--target", server.address, "--timeout", "2"]) == 1
    assert cli.main(["health", "--target", server.address, "--tls-ca", str(ROOT / "no-such.pem")]) == 2
    assert "no-such.pem" in capsys.readouterr().err


def test_tls_options_check_files(certs: CertFiles, tmp_path: Path) -> None:
    """TLSOptions refuses a lone cert or key, and names an unreadable or invalid file."""
    with pytest.raises(ValueError, match="go together"):
        TLSOptions(ca_file=certs.ca, cert_file=certs.client_cert)
    with pytest.raises(ValueError, match="missing.pem"):
        TLSOptions(ca_file=tmp_path / "missing.pem").credentials()
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"TLSOptions.ca_file: .*junk.pem holds no valid PEM certificate"):
        TLSOptions(ca_file=junk).credentials()
    with pytest.raises(
        ValueError, match=r"TLSOptions.key_file: .*server.key is not a PEM private key matching"
    ):
        TLSOptions(certs.ca, certs.client_cert, certs.server_key).credentials()


# -- /metrics over HTTPS ------------------------------------------------------------------


def https_context(certs: CertFiles, *, client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if client_cert:
        ctx.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return ctx


def fetch(url: str, ctx: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:  # noqa: S310 - loopback test server
        return str(resp.read().decode())


@pytest.mark.parametrize("mutual", [False, True])
def test_metrics_over_https(certs: CertFiles, mutual: bool) -> None:
    """/metrics with [server.metrics_tls]: a real HTTPS client with the test CA scrapes it;
    plain HTTP is refused, and with a client CA so is a scraper without a certificate."""
    m = Metrics()
    address = m.start_http("127.0.0.1:0", server_tls(certs, mutual=mutual))
    try:
        body = fetch(f"https://{address}/metrics", https_context(certs, client_cert=True))
        assert "kvcoord_build_info" in body
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            fetch(f"http://{address}/metrics")
        no_cert = https_context(certs, client_cert=False)
        if mutual:
            with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
                fetch(f"https://{address}/metrics", no_cert)
        else:
            assert "kvcoord_build_info" in fetch(f"https://{address}/metrics", no_cert)
    finally:
        m.stop_http()


def test_a_stalled_handshake_does_not_block_other_scrapes(certs: CertFiles) -> None:
    """A peer that connects to the HTTPS /metrics port and sends nothing does not stop a
    real scraper (the handshake runs in the connection's own thread, not the accept loop)."""
    m = Metrics()
    address = m.start_http("127.0.0.1:0", server_tls(certs, mutual=True))
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10):
            body = fetch(f"https://{address}/metrics", https_context(certs, client_cert=True))
            assert "kvcoord_build_info" in body
    finally:
        m.stop_http()


def test_serve_process_with_tls_from_environment(certs: CertFiles) -> None:
    """`kvcoord serve` with KVCOORD_TLS_* and KVCOORD_METRICS_TLS_*: gRPC needs a client
    certificate, /metrics is HTTPS with client certificates, and both say so at start."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT / 'client'}:{ROOT / 'server'}"
    for prefix in ("KVCOORD_TLS_", "KVCOORD_METRICS_TLS_"):
        env[prefix + "CERT"] = str(certs.server_cert)
        env[prefix + "KEY"] = str(certs.server_key)
        env[prefix + "CLIENT_CA"] = str(certs.ca)
    env["KVCOORD_LISTEN"] = "127.0.0.1:0"
    env["KVCOORD_METRICS_LISTEN"] = "127.0.0.1:0"
    server = start_server(None, metrics=True, env=env)
    try:
        with KVCoordClient(server.address, tls=client_tls(certs), timeout=10) as c:
            assert [p.name for p in c.list_pools().pools] == ["default"]
        assert refused(server.address, client_tls(certs, cert=False)) == grpc.StatusCode.UNAVAILABLE
        assert server.metrics_address is not None
        body = fetch(f"https://{server.metrics_address}/metrics", https_context(certs, client_cert=True))
        assert "kvcoord_blocks_usable" in body
        log = server.log()
        assert "; mutual TLS" in log and f"https://{server.metrics_address}/metrics (mutual TLS)" in log
    finally:
        assert server.stop() == 0


def test_serve_refuses_a_missing_certificate_file(tmp_path: Path, certs: CertFiles) -> None:
    """A TLS file named in the environment that does not exist stops `kvcoord serve` at
    load, with exit status 2 and a message naming the key and the file."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT / 'client'}:{ROOT / 'server'}"
    env["KVCOORD_TLS_CERT"] = str(tmp_path / "nope.pem")
    env["KVCOORD_TLS_KEY"] = str(certs.server_key)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcoord.service.cli",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "server.tls.cert_file" in proc.stderr and "nope.pem" in proc.stderr
