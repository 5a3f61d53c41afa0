"""Test certificates, generated at test time with ``cryptography``: a CA, a server
certificate for 127.0.0.1 / localhost, a client certificate, a second CA with a
client certificate of its own (one the first CA does not trust), and client
certificates of the first CA named by one SAN each (of every type, subject CN "no-tenant").

    python tests/certs.py DIR     writes them into DIR (scripts/test.sh does, for the container)
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["SAN_NAMES", "CertFiles", "write_certs"]


@dataclasses.dataclass(frozen=True)
class CertFiles:
    """Paths of the generated PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path
    #: SAN type ("dns", "uri", "email", "ip") -> (certificate, key) of a client whose
    #: only name besides the CN "no-tenant" is that SAN (see SAN_NAMES)
    san_clients: dict[str, tuple[Path, Path]] = dataclasses.field(default_factory=dict)
    #: subject CN -> (certificate, key) of a client with that CN and no SAN: the DNS
    #: SAN of SAN_NAMES as a CN (typed identities must tell them apart)
    cn_clients: dict[str, tuple[Path, Path]] = dataclasses.field(default_factory=dict)


#: the SAN each of CertFiles.san_clients carries
SAN_NAMES = {
    "dns": "w.example.test",
    "uri": "spiffe://example.test/w",
    "email": "ops@example.test",
    "ip": "10.1.2.3",
}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _builder(
    subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
    )


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (
        _builder(cn, _name(cn), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    cn: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    ca_cert, ca_key = ca
    b = (
        _builder(cn, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if names:
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    # Test keys only: readable by the container's non-root user through a bind mount.
    os.chmod(path, 0o644)
    return path


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_certs(directory: Path) -> CertFiles:
    """Generate every certificate and key into ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    ca = _ca("kvcoord test CA")
    other = _ca("some other CA")
    server = _leaf(
        "kvcoord server",
        ca,
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = _leaf("worker-1", ca, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    stranger = _leaf("worker-x", other, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    d = directory
    sans: dict[str, x509.GeneralName] = {
        "dns": x509.DNSName(SAN_NAMES["dns"]),
        "uri": x509.UniformResourceIdentifier(SAN_NAMES["uri"]),
        "email": x509.RFC822Name(SAN_NAMES["email"]),
        "ip": x509.IPAddress(ipaddress.ip_address(SAN_NAMES["ip"])),
    }
    san_clients = {}
    for kind, name in sans.items():
        cert, key = _leaf("no-tenant", ca, ExtendedKeyUsageOID.CLIENT_AUTH, [name])
        san_clients[kind] = (
            _write(d / f"client-{kind}.pem", _pem_cert(cert)),
            _write(d / f"client-{kind}.key", _pem_key(key)),
        )
    cn_clients = {}
    for i, cn in enumerate([SAN_NAMES["dns"]]):
        cert, key = _leaf(cn, ca, ExtendedKeyUsageOID.CLIENT_AUTH, [])
        cn_clients[cn] = (
            _write(d / f"client-cn-{i}.pem", _pem_cert(cert)),
            _write(d / f"client-cn-{i}.key", _pem_key(key)),
        )
    return CertFiles(
        ca=_write(d / "ca.pem", _pem_cert(ca[0])),
        server_cert=_write(d / "server.pem", _pem_cert(server[0])),
        server_key=_write(d / "server.key", _pem_key(server[1])),
        client_cert=_write(d / "client.pem", _pem_cert(client[0])),
        client_key=_write(d / "client.key", _pem_key(client[1])),
        other_ca=_write(d / "other-ca.pem", _pem_cert(other[0])),
        other_client_cert=_write(d / "other-client.pem", _pem_cert(stranger[0])),
        other_client_key=_write(d / "other-client.key", _pem_key(stranger[1])),
        san_clients=san_clients,
        cn_clients=cn_clients,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/certs.py DIR")
    files = write_certs(Path(sys.argv[1]))
    print(f"certificates in {files.ca.parent}")
