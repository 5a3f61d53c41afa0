"""TLS settings of the server's listeners: certificate files, checked on load.

``[server.tls]`` applies to every gRPC TCP listener, ``[server.metrics_tls]`` to the
/metrics listener. With ``cert_file`` and ``key_file`` set the listener speaks only TLS;
with ``client_ca_file`` too, clients must present a certificate signed by that CA
(mutual TLS). Unix-socket listeners (``unix:/path``) stay plaintext: only processes that
may open the socket file reach them, so file permissions are their access control.

Certificates are read when the server starts; replacing them takes a restart.

``[cluster.peer_tls]`` is the other direction: how a replica dials the other replicas
of its cluster (handovers, ``Replicas.AdoptPool``). Every replica serves the same
``[server.tls]``, so a replica whose listener uses TLS dials its peers with TLS too:
their certificates are verified against ``peer_tls.ca_file`` (default:
``[server.tls] client_ca_file``, else the system roots) and, when the peers require
client certificates (``client_ca_file`` is set), it presents ``peer_tls.cert_file`` /
``key_file`` (default: its own ``[server.tls]`` certificate and key, which must then
allow client authentication too: extended key usage ``clientAuth``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import grpc
from kvcoord.wire.pem import read_ca_file, read_key_pair

__all__ = [
    "PeerTLS",
    "TLSFiles",
    "check_tls_files",
    "peer_credentials",
    "peer_tls_from_dict",
    "server_credentials",
    "tls_from_dict",
    "tls_from_env",
]


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
    return TLSFiles(**_string_table(d, where, tuple(ENV_SUFFIXES)))


def _string_table(d: Any, where: str, keys: tuple[str, ...]) -> dict[str, str]:
    """``d`` checked to be a table of strings under ``keys``.

    Raises:
        ValueError: not a table, an unknown key, or a value that is not a string.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: must be a table with {', '.join(keys)}")
    for key, value in d.items():
        if key not in keys:
            raise ValueError(f"{where}: unknown key {key!r} (known: {sorted(keys)})")
        if not isinstance(value, str):
            raise ValueError(f"{where}.{key}: must be a file path (string), got {type(value).__name__}")
    return dict(d)


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


@dataclasses.dataclass(frozen=True, slots=True)
class PeerTLS:
    """``[cluster.peer_tls]``: how this replica dials the others when ``[server.tls]``
    is on (see the module docstring); every field empty takes the defaults."""

    #: verifies the peers' server certificates (default: server.tls.client_ca_file)
    ca_file: str = ""
    #: the client certificate shown to peers that require one (default: server.tls's)
    cert_file: str = ""
    key_file: str = ""
    #: the name the peers' certificates are checked against instead of the host of
    #: their advertised address (an address the certificates do not list)
    server_name: str = ""


_PEER_KEYS = ("ca_file", "cert_file", "key_file", "server_name")


def peer_tls_from_dict(d: Any, where: str) -> PeerTLS:
    """A ``[cluster.peer_tls]`` table, its files checked.

    Raises:
        ValueError: not a table, an unknown key, a value that is not a string, a
            certificate without its key, or a file that is missing or does not parse.
    """
    peer = PeerTLS(**_string_table(d, where, _PEER_KEYS))
    if bool(peer.cert_file) != bool(peer.key_file):
        raise ValueError(f"{where}: cert_file and key_file go together")
    if peer.ca_file:
        read_ca_file(peer.ca_file, f"{where}.ca_file")
    if peer.cert_file:
        read_key_pair(peer.cert_file, peer.key_file, f"{where}.cert_file", f"{where}.key_file")
    return peer


def peer_credentials(
    server: TLSFiles, peer: PeerTLS
) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]] | None:
    """The channel credentials and options of calls to the other replicas; None when
    the replicas serve plaintext (no ``[server.tls]``).

    Raises:
        ValueError: a file is unreadable or invalid.
    """
    if not server.enabled:
        return None
    ca = peer.ca_file or server.client_ca_file
    roots = read_ca_file(ca, "cluster.peer_tls.ca_file") if ca else None
    chain = key = None
    if peer.cert_file:
        chain, key = read_key_pair(
            peer.cert_file, peer.key_file, "cluster.peer_tls.cert_file", "cluster.peer_tls.key_file"
        )
    elif server.mutual:  # the peers require a client certificate: this replica's own
        chain, key = read_key_pair(
            server.cert_file, server.key_file, "server.tls.cert_file", "server.tls.key_file"
        )
    options = [("grpc.ssl_target_name_override", peer.server_name)] if peer.server_name else []
    credentials = grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=key, certificate_chain=chain
    )
    return credentials, options
