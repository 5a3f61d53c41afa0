"""TLS settings of the server's listeners: certificate files, checked on load.

``[server.tls]`` applies to every gRPC TCP listener, ``[server.metrics_tls]`` to the
/metrics listener. With ``cert_file`` and ``key_file`` set the listener speaks only TLS;
with ``client_ca_file`` too, clients must present a certificate signed by that CA
(mutual TLS). Unix-socket listeners (``unix:/path``) stay plaintext: only processes that
may open the socket file reach them, so file permissions are their access control.

Certificates are read when the server starts; replacing them takes a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import grpc
from kvcoord.wire.pem import read_ca_file, read_key_pair

__all__ = ["TLSFiles", "check_tls_files", "server_credentials", "tls_from_dict", "tls_from_env"]


@dataclasses.dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files of one listener; all empty means plaintext."""

    cert_file: str = ""
    key_file: str = ""
    #: Non-empty: client certificates are required and verified against this CA.
    client_ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def describe(self) -> str:
        return "mutual TLS" if self.mutual else "TLS" if self.enabled else "plaintext"


#: Environment variable suffix per field, after a prefix (KVCOORD_TLS_, KVCOORD_METRICS_TLS_).
ENV_SUFFIXES = {"cert_file": "CERT", "key_file": "KEY", "client_ca_file": "CLIENT_CA"}


def tls_from_dict(d: Any, where: str) -> TLSFiles:
    """A ``[server.tls]``-style table as :class:`TLSFiles` (structure only; see :func:`check_tls_files`).

    Raises:
        ValueError: not a table, an unknown key, or a value that is not a string.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: must be a table with {', '.join(ENV_SUFFIXES)}")
    for key, value in d.items():
        if key not in ENV_SUFFIXES:
            raise ValueError(f"{where}: unknown key {key!r} (known: {sorted(ENV_SUFFIXES)})")
        if not isinstance(value, str):
            raise ValueError(f"{where}.{key}: must be a file path (string), got {type(value).__name__}")
    return TLSFiles(**d)


def tls_from_env(base: TLSFiles, env: Mapping[str, str], prefix: str) -> TLSFiles:
    """``base`` with the fields whose ``<prefix><SUFFIX>`` variable is set and non-empty."""
    overrides = {
        f: env[prefix + s].strip() for f, s in ENV_SUFFIXES.items() if env.get(prefix + s, "").strip()
    }
    return dataclasses.replace(base, **overrides) if overrides else base


def check_tls_files(tls: TLSFiles, where: str) -> None:
    """Every named file exists and parses, and the key matches the certificate.

    Raises:
        ValueError: names the key (``where.cert_file`` ...) and the file, never its contents.
    """
    if bool(tls.cert_file) != bool(tls.key_file):
        given = "cert_file" if tls.cert_file else "key_file"
        raise ValueError(f"{where}: cert_file and key_file go together (only {given} is set)")
    if tls.client_ca_file and not tls.cert_file:
        raise ValueError(
            f"{where}.client_ca_file: mutual TLS needs the server's own cert_file and key_file too"
        )
    if tls.cert_file:
        read_key_pair(tls.cert_file, tls.key_file, f"{where}.cert_file", f"{where}.key_file")
    if tls.client_ca_file:
        read_ca_file(tls.client_ca_file, f"{where}.client_ca_file")


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """gRPC credentials for a TLS listener (client certificates required when a client CA is set).

    Raises:
        ValueError: a file is unreadable or invalid.
    """
    chain, key = read_key_pair(tls.cert_file, tls.key_file, "server.tls.cert_file", "server.tls.key_file")
    roots = read_ca_file(tls.client_ca_file, "server.tls.client_ca_file") if tls.mutual else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=roots, require_client_auth=tls.mutual
    )
