"""TLS for client channels.

The PEM files are read and checked by :mod:`kvcoord.wire.pem` (shared with the server's
listeners): a file that cannot be read or parsed fails at once with a ``ValueError``
naming it, rather than as an opaque handshake failure on the first call.
"""

from __future__ import annotations

import dataclasses

import grpc
from kvcoord.wire.pem import PathArg, read_ca_file, read_key_pair

__all__ = ["TLSOptions"]


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
