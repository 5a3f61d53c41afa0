"""[server.tls] / [server.metrics_tls] and their environment variables: parsed, and every
file checked on load with an error naming the key and the file (never its contents)."""

from __future__ import annotations

from pathlib import Path

import pytest
from certs import CertFiles
from kvcoord.service.access import certificate_names
from kvcoord.service.config import ConfigFileError, load_config, parse_config
from kvcoord.service.tls import TLSFiles


def tls_toml(table: str, **files: object) -> str:
    return f"[server.{table}]\n" + "".join(f'{k} = "{v}"\n' for k, v in files.items())


def test_embedded_default_is_plaintext_with_metrics_on_loopback() -> None:
    """The embedded default names no certificate, and /metrics listens on 127.0.0.1 only."""
    s = load_config(env={}).server
    assert s.tls == TLSFiles() and s.metrics_tls == TLSFiles()
    assert not s.tls.enabled and s.tls.describe() == "plaintext"
    assert s.metrics_listen.startswith("127.0.0.1:")


def test_tls_tables_parse(certs: CertFiles) -> None:
    """Both tables load into TLSFiles; a client CA makes it mutual."""
    text = tls_toml("tls", cert_file=certs.server_cert, key_file=certs.server_key, client_ca_file=certs.ca)
    text += tls_toml("metrics_tls", cert_file=certs.server_cert, key_file=certs.server_key)
    s = parse_config(text).server
    assert s.tls == TLSFiles(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    assert s.tls.describe() == "mutual TLS" and s.metrics_tls.describe() == "TLS"


def test_environment_variables(certs: CertFiles) -> None:
    """KVCOORD_TLS_* and KVCOORD_METRICS_TLS_* set each listener's files independently."""
    env = {
        "KVCOORD_TLS_CERT": str(certs.server_cert),
        "KVCOORD_TLS_KEY": str(certs.server_key),
        "KVCOORD_TLS_CLIENT_CA": str(certs.ca),
        "KVCOORD_METRICS_TLS_CERT": str(certs.server_cert),
        "KVCOORD_METRICS_TLS_KEY": str(certs.server_key),
    }
    s = load_config(env=env).server
    assert s.tls == TLSFiles(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    assert s.metrics_tls == TLSFiles(str(certs.server_cert), str(certs.server_key), "")


def test_environment_files_are_checked(certs: CertFiles, tmp_path: Path) -> None:
    """A file named only in the environment is checked too."""
    env = {
        "KVCOORD_METRICS_TLS_CERT": str(tmp_path / "gone.pem"),
        "KVCOORD_METRICS_TLS_KEY": str(certs.server_key),
    }
    with pytest.raises(ConfigFileError, match=r"server\.metrics_tls\.cert_file: cannot read .*gone\.pem"):
        load_config(env=env)


def _junk(tmp_path: Path) -> Path:
    p = tmp_path / "junk.pem"
    p.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    return p


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (
            {"cert_file": "MISSING", "key_file": "server_key"},
            r"server\.tls\.cert_file: cannot read .*missing\.pem",
        ),
        (
            {"cert_file": "server_cert", "key_file": "MISSING"},
            r"server\.tls\.key_file: cannot read .*missing\.pem",
        ),
        (
            {"cert_file": "JUNK", "key_file": "server_key"},
            r"server\.tls\.cert_file: .*junk\.pem holds no valid PEM",
        ),
        (
            {"cert_file": "server_cert", "key_file": "client_key"},
            r"server\.tls\.key_file: .*client\.key is not a PEM private key matching the certificate in .*server\.pem",
        ),
        (
            {"cert_file": "server_cert", "key_file": "server_key", "client_ca_file": "JUNK"},
            r"server\.tls\.client_ca_file: .*junk\.pem holds no valid PEM",
        ),
        ({"cert_file": "server_cert"}, r"server\.tls: cert_file and key_file go together \(only cert_file"),
        (
            {"client_ca_file": "ca"},
            r"server\.tls\.client_ca_file: mutual TLS needs the server's own cert_file",
        ),
    ],
)
def test_bad_tls_files_name_the_key_and_file(
    certs: CertFiles, tmp_path: Path, files: dict[str, str], message: str
) -> None:
    """Missing, unparsable or mismatched files fail on load, naming the key and the file."""
    paths = {"MISSING": tmp_path / "missing.pem", "JUNK": _junk(tmp_path)}
    resolved = {k: paths.get(v) or getattr(certs, v) for k, v in files.items()}
    with pytest.raises(ConfigFileError, match=message):
        parse_config(tls_toml("tls", **resolved))


def test_encrypted_key_is_refused_without_prompting(certs: CertFiles, tmp_path: Path) -> None:
    """An encrypted key fails with a clear message instead of a passphrase prompt."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), None)
    enc = tmp_path / "enc.key"
    enc.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    with pytest.raises(ConfigFileError, match=r"server\.tls\.key_file: .*enc\.key is an encrypted key"):
        parse_config(tls_toml("tls", cert_file=certs.server_cert, key_file=enc))


def test_errors_never_quote_key_material(certs: CertFiles) -> None:
    """A private key given where a certificate belongs is named, not printed."""
    with pytest.raises(ConfigFileError) as info:
        parse_config(tls_toml("tls", cert_file=certs.server_key, key_file=certs.server_key))
    assert "server.tls.cert_file" in str(info.value)
    body = certs.server_key.read_text().splitlines()[1]
    assert "PRIVATE KEY" not in str(info.value) and body not in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server.tls]\ncertfile = "x"\n', r"server\.tls: unknown key 'certfile'"),
        ("[server.tls]\ncert_file = 1\n", r"server\.tls\.cert_file: must be a file path"),
        ('[server]\ntls = "on"\n', r"server\.tls: must be a table"),
    ],
)
def test_tls_table_structure(text: str, message: str) -> None:
    """Unknown keys and wrong types in a TLS table are refused with the key path."""
    with pytest.raises(ConfigFileError, match=message):
        parse_config(text)


def test_certificate_names_are_typed_by_field() -> None:
    """The auth context's CN, DNS and URI names come out typed (cn:, dns:, uri:), so
    one field's value never matches an identity of another; email and IP SANs are not
    names."""
    context = {
        "x509_common_name": [b"w.example.test"],
        "peer_dns": [b"a.example.test", b"b.example.test"],
        "peer_uri": [b"spiffe://example.test/w"],
        "x509_subject_alternative_name": [b"ops@example.test"],
    }
    assert certificate_names(context) == [
        "cn:w.example.test",
        "dns:a.example.test",
        "dns:b.example.test",
        "uri:spiffe://example.test/w",
    ]


@pytest.mark.parametrize(
    ("identity", "message"),
    [
        ("worker-1", r'identities\[0\]: .worker-1. names no certificate field: write "cn:worker-1"'),
        ("spiffe://x/y", r'write "cn:spiffe://x/y" \(subject CN\), "dns:spiffe://x/y" \(DNS SAN\) or "uri:'),
        ("email:ops@example.test", "email and IP SANs name no tenant"),
        ("dns:", "names no certificate field"),
    ],
)
def test_untyped_identities_are_refused_naming_the_fix(identity: str, message: str) -> None:
    """An identity without its type (as configs before typing had) is refused when the
    file loads, naming the typed spellings; typed ones load."""
    with pytest.raises(ConfigFileError, match=message):
        parse_config(f'[tenants.t]\nidentities = ["{identity}"]\n')
    cfg = parse_config(
        '[tenants.t]\nidentities = ["cn:worker-1", "dns:w.example.test", "uri:spiffe://x/y"]\n'
    )
    assert cfg.tenants[0].identities == ("cn:worker-1", "dns:w.example.test", "uri:spiffe://x/y")
