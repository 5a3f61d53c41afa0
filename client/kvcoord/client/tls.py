"""TLS for client channels, and the PEM checks the server's config loader shares.

A file that cannot be read or parsed fails at once with a ``ValueError`` naming it,
rather than as an opaque handshake failure on the first call. Only ``ssl`` from the
standard library is used to parse: the client needs nothing beyond grpcio.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from typing import NoReturn

import grpc

__all__ = ["TLSOptions", "read_ca_file", "read_key_pair"]

PathArg = str | os.PathLike[str]


def _read(path: PathArg, label: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{label}: cannot read {os.fspath(path)}: {exc.strerror or exc}") from None


def _encrypted_key() -> NoReturn:
    # Called by OpenSSL only for an encrypted key; without it OpenSSL would prompt on the tty.
    raise ValueError("encrypted")


def read_ca_file(path: PathArg, label: str = "ca_file") -> bytes:
    """The PEM certificates of ``path``, checked to hold at least one.

    Raises:
        ValueError: unreadable, or no PEM certificate in it (the message names ``label`` and the file).
    """
    data = _read(path, label)
    try:
        ssl.create_default_context(cadata=data.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(
            f"{label}: {os.fspath(path)} holds no valid PEM certificate ({type(exc).__name__}: {exc})"
        ) from None
    return data


def read_key_pair(
    cert_file: PathArg, key_file: PathArg, cert_label: str = "cert_file", key_label: str = "key_file"
) -> tuple[bytes, bytes]:
    """A PEM certificate chain and its unencrypted private key, checked to match.

    Returns:
        ``(certificate_chain, private_key)`` as bytes.

    Raises:
        ValueError: a file is unreadable, not PEM, encrypted, or the key does not belong
            to the certificate; the message names the file (never its contents).
    """
    chain = read_ca_file(cert_file, cert_label)
    key = _read(key_file, key_label)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(os.fspath(cert_file), os.fspath(key_file), password=_encrypted_key)
    except ValueError:
        raise ValueError(
            f"{key_label}: {os.fspath(key_file)} is an encrypted key; give an unencrypted PEM key "
            "(protect it with file permissions)"
        ) from None
    except ssl.SSLError as exc:
        raise ValueError(
            f"{key_label}: {os.fspath(key_file)} is not a PEM private key matching the certificate in "
            f"{os.fspath(cert_file)} ({exc.reason or exc})"
        ) from None
    return chain, key


@dataclasses.dataclass(frozen=True, slots=True)
class TLSOptions:
    """How a client reaches a server whose listener uses TLS.

    Args:
        ca_file: PEM certificates that verify the server; ``None`` uses the system roots.
        cert_file: the client's PEM certificate chain, for servers that require client
            certificates (mutual TLS); needs ``key_file``.
        key_file: the unencrypted PEM private key of ``cert_file``.
        server_name_override: the name to verify the server certificate against instead
            of the target's host (e.g. when connecting by an address the certificate does
            not list).

    Raises:
        ValueError: only one of ``cert_file`` and ``key_file`` is given.
    """

    ca_file: PathArg | None = None
    cert_file: PathArg | None = None
    key_file: PathArg | None = None
    server_name_override: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "TLSOptions: cert_file and key_file go together (a client certificate needs its key)"
            )

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials, reading and checking the files now.

        Raises:
            ValueError: a file is unreadable or invalid (named in the message).
        """
        roots = read_ca_file(self.ca_file, "TLSOptions.ca_file") if self.ca_file is not None else None
        chain = key = None
        if self.cert_file is not None and self.key_file is not None:
            chain, key = read_key_pair(
                self.cert_file, self.key_file, "TLSOptions.cert_file", "TLSOptions.key_file"
            )
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)

    def channel_options(self) -> list[tuple[str, str]]:
        """Extra channel arguments (the server name override, when set)."""
        if self.server_name_override:
            return [("grpc.ssl_target_name_override", self.server_name_override)]
        return []
