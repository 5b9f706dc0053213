"""TLS files (certificate, key, CA) from flags or the environment, and client channel credentials.

A client (the CLI, a host, a caller) uses TLS when it is given a CA (to trust
the services' certificates) or asks for it with `--tls` / TOOLMESH_TLS=1 (the
system's roots); a certificate and key make it present a client certificate.
Services read the same variables for their own certificate (toolmesh.runtime.tls).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

ENV_CERT = "TOOLMESH_TLS_CERT"
ENV_KEY = "TOOLMESH_TLS_KEY"
ENV_CA = "TOOLMESH_TLS_CA"
ENV_TLS = "TOOLMESH_TLS"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: a certificate chain and its private key, and a CA bundle to trust."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS certificate and its key go together (--tls-cert and --tls-key)")

    @classmethod
    def from_env(cls, cert: str | None = None, key: str | None = None, ca: str | None = None) -> TlsFiles:
        """Flags first, then TOOLMESH_TLS_CERT / TOOLMESH_TLS_KEY / TOOLMESH_TLS_CA."""
        cert = cert or os.environ.get(ENV_CERT)
        key = key or os.environ.get(ENV_KEY)
        ca = ca or os.environ.get(ENV_CA)
        return cls(Path(cert) if cert else None, Path(key) if key else None, Path(ca) if ca else None)

    @property
    def configured(self) -> bool:
        return self.cert is not None or self.ca is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS to a server whose certificate the CA (or, without one, the system) trusts;
        with a certificate and key, presenting them as the client's."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


def client_credentials(
    tls: bool = False, cert: str | None = None, key: str | None = None, ca: str | None = None
) -> grpc.ChannelCredentials | None:
    """A client's channel credentials from flags and the environment; None means plaintext.

    TLS when asked (`tls`, TOOLMESH_TLS=1) or when a CA or client certificate is given.
    Raises ValueError for a certificate without its key, OSError for a file that cannot be read.
    """
    files = TlsFiles.from_env(cert, key, ca)
    wanted = tls or os.environ.get(ENV_TLS, "").lower() in {"1", "true", "yes"}
    if not (wanted or files.configured):
        return None
    return files.channel_credentials()
