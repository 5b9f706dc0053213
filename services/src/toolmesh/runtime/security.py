"""How a service is secured: TLS files, token verification, and refusing to serve unprotected.

Plaintext without authentication is the embedded default, on loopback only.
Like Redis's protected mode, a listener on any other address is refused at
startup unless it is protected (TLS and tokens for the public listener,
mutual TLS for the internal one) or the operator passes --insecure.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import grpc

from toolmesh.auth.tokens import (
    DEFAULT_AUDIENCE,
    DEFAULT_ISSUER,
    ENV_AUDIENCE,
    ENV_ISSUER,
    ENV_JWKS,
    ENV_SECRET,
    ENV_SECRET_FILE,
    Verifier,
    keys_from,
    read_secret,
)
from toolmesh.core.channels import is_loopback_host
from toolmesh.core.tls import TlsFiles
from toolmesh.runtime.tls import server_credentials


class Unprotected(ValueError):
    """A listener would be reachable off this machine without protection."""


@dataclass(frozen=True)
class Security:
    """TLS files (the service's certificate, its key, and the CA of its peers) and token verification."""

    tls: TlsFiles = field(default_factory=TlsFiles)
    verifier: Verifier | None = None
    # The operator accepts serving off loopback without protection.
    insecure: bool = False

    @property
    def serves_tls(self) -> bool:
        return self.tls.cert is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls.cert is not None and self.tls.ca is not None

    def check_public(self, address: str) -> None:
        if self.insecure or is_loopback(address) or (self.serves_tls and self.verifier is not None):
            return
        raise Unprotected(
            f"refusing to serve {address} without TLS and authentication: anyone who can reach it could "
            "serve or call any session's tools. Configure --tls-cert/--tls-key and --auth-secret "
            "(or --auth-jwks), bind 127.0.0.1, or pass --insecure to serve it anyway."
        )

    def check_internal(self, address: str) -> None:
        if self.insecure or is_loopback(address) or self.mutual_tls:
            return
        raise Unprotected(
            f"refusing to serve the internal listener on {address} without mutual TLS: anyone who can "
            "reach it could run any session's tools. Configure --tls-cert, --tls-key and --tls-ca, "
            "bind 127.0.0.1, or pass --insecure to serve it anyway."
        )

    def public_credentials(self) -> grpc.ServerCredentials | None:
        return server_credentials(self.tls, require_client_cert=False) if self.serves_tls else None

    def internal_credentials(self) -> grpc.ServerCredentials | None:
        if not self.serves_tls:
            return None
        return server_credentials(self.tls, require_client_cert=self.mutual_tls)

    def peer_credentials(self) -> grpc.ChannelCredentials | None:
        """For this service's own calls to the others' internal listeners: mutual TLS when configured."""
        return self.tls.channel_credentials() if self.serves_tls else None


LOOPBACK = Security()


def is_loopback(address: str) -> bool:
    """Whether `address` (host:port, [v6]:port, unix:path) can only be reached from this machine."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    return is_loopback_host(address.rsplit(":", 1)[0].strip("[]"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every service command (each also read from its environment variable)."""
    group = parser.add_argument_group("security")
    group.add_argument("--tls-cert", help="PEM certificate chain to serve TLS with (env TOOLMESH_TLS_CERT)")
    group.add_argument("--tls-key", help="its PEM private key (env TOOLMESH_TLS_KEY)")
    group.add_argument(
        "--tls-ca",
        help="PEM CA bundle: client certificates on the internal listener must chain to it, and so must "
        "the certificates of the services this one calls (env TOOLMESH_TLS_CA)",
    )
    group.add_argument(
        "--auth-secret",
        help=f"HS256 shared secret for tokens, 32 bytes or more (env {ENV_SECRET}; flags show in ps)",
    )
    group.add_argument("--auth-secret-file", help=f"file holding the shared secret (env {ENV_SECRET_FILE})")
    group.add_argument("--auth-jwks", help=f"JWKS file path or https URL of the token keys (env {ENV_JWKS})")
    group.add_argument(
        "--auth-issuer", help=f"required token issuer (env {ENV_ISSUER}; default {DEFAULT_ISSUER})"
    )
    group.add_argument(
        "--auth-audience", help=f"required token audience (env {ENV_AUDIENCE}; default {DEFAULT_AUDIENCE})"
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="serve off loopback without TLS and authentication (anyone who can reach it may do anything)",
    )


def from_args(args: argparse.Namespace) -> Security:
    """The security the flags and environment describe. Raises ValueError (or OSError) when unusable."""
    tls = TlsFiles.from_env(args.tls_cert, args.tls_key, args.tls_ca)
    if tls.ca is not None and tls.cert is None:
        raise ValueError("--tls-ca needs the service's own --tls-cert and --tls-key")
    secret = read_secret(
        args.auth_secret or os.environ.get(ENV_SECRET),
        args.auth_secret_file or os.environ.get(ENV_SECRET_FILE),
    )
    keys = keys_from(secret, args.auth_jwks or os.environ.get(ENV_JWKS))
    verifier = None
    if keys is not None:
        verifier = Verifier(
            keys,
            issuer=args.auth_issuer or os.environ.get(ENV_ISSUER) or DEFAULT_ISSUER,
            audience=args.auth_audience or os.environ.get(ENV_AUDIENCE) or DEFAULT_AUDIENCE,
        )
    return Security(tls, verifier, args.insecure)
