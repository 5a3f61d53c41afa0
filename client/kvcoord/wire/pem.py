"""PEM files, read and checked once for both sides: the client's channel credentials
and the server's listeners use the same readers.

A file that cannot be read or parsed fails at once with a ``ValueError`` naming it
(never its contents), rather than as an opaque handshake failure on the first call.
Only ``ssl`` from the standard library parses.
"""

from __future__ import annotations

import os
import ssl
from typing import NoReturn

__all__ = ["PathArg", "read_ca_file", "read_key_pair"]

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
