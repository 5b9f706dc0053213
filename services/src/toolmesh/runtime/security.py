"""How a service is secured: TLS files, token verification, and refusing to serve unprotected.

Plaintext without authentication is the embedded default, on loopback only.
Like Redis's protected mode, a listener on any other address is refused at
startup unless it is protected (TLS and tokens for the public listener,
mutual TLS for the internal one) or the operator passes --insecure.

The internal listeners admit toolmesh services only (toolmesh.auth.service):
under mutual TLS, a client certificate naming a service identity; with a
service token, that token; with tokens on and no mutual TLS, a service token
is required (a tenant's token or certificate is never enough).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace

import grpc

from toolmesh.auth.service import (
    DEFAULT_SERVICE_IDENTITY,
    ENV_SERVICE_IDENTITY,
    ENV_SERVICE_TOKEN,
    ENV_SERVICE_TOKEN_FILE,
    ServiceCredential,
    generate_service_token,
    read_service_token,
)
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
from toolmesh.runtime.peers import certificate_uris, open_peer_channel
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
    # What the services send each other's internal listeners, compared there in constant time.
    service_token: str | None = field(default=None, repr=False)
    # Under mutual TLS, the URI SAN (or prefix ending in "/") service certificates carry.
    service_identity: str = DEFAULT_SERVICE_IDENTITY

    @property
    def service(self) -> ServiceCredential:
        """What a caller of an internal RPC must show."""
        identity = self.service_identity if self.mutual_tls else None
        return ServiceCredential(self.service_token, identity)

    def with_service_token(self) -> Security:
        """For services started together in one process: a random service token when tokens are
        on and none is configured, so that they admit each other and no one else."""
        if self.verifier is None or self.service_token is not None:
            return self
        return replace(self, service_token=generate_service_token())

    def check_service(self) -> None:
        """Raise Unprotected when tokens are on but nothing tells services from tenants internally."""
        if self.verifier is not None and not self.mutual_tls and self.service_token is None:
            raise Unprotected(
                "refusing to serve the internal listeners with tokens but without a service credential: "
                "any process that reaches them could run any session's tools. Configure "
                f"--service-token-file (env {ENV_SERVICE_TOKEN_FILE} or {ENV_SERVICE_TOKEN}), the same "
                "for every service, or mutual TLS (--tls-cert, --tls-key, --tls-ca)."
            )

    def check_peer(self) -> None:
        """For a service that calls internal listeners: raise Unprotected when they would refuse it
        (no service token with tokens on; under mutual TLS, a certificate without the identity)."""
        self.check_service()
        if not self.mutual_tls:
            return
        assert self.tls.cert is not None
        if not ServiceCredential(identity=self.service_identity).names_service(
            certificate_uris(self.tls.cert.read_bytes())
        ):
            raise Unprotected(
                f"the certificate {self.tls.cert} names no service identity ({self.service_identity}"
                f"{'<name>' if self.service_identity.endswith('/') else ''} as a URI subject alternative "
                "name): the other services' internal listeners would refuse it. Issue the services' "
                "certificates with it, or set --service-identity to the one they carry."
            )

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

    def check_metrics(self, address: str) -> None:
        """The metrics endpoint (toolmesh.core.scrape): off loopback, only over TLS or when told."""
        if self.insecure or is_loopback(address) or self.serves_tls:
            return
        raise Unprotected(
            f"refusing to serve metrics on {address} without TLS: anyone who can reach it could read them. "
            "Configure --tls-cert/--tls-key (and --tls-ca for client certificates), bind 127.0.0.1, "
            "or pass --insecure to serve it anyway."
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

    def peer_channel(self, target: str, *, balanced: bool = False) -> grpc.aio.Channel:
        """A channel to another service's internal listener, with this service's credentials;
        `balanced`: round_robin over the addresses `target` resolves to."""
        return open_peer_channel(target, self.peer_credentials(), self.service_token, balanced=balanced)


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
        "--service-token-file",
        help="file holding the token the services show each other's internal listeners, the same for "
        f"every service, 32 characters or more (env {ENV_SERVICE_TOKEN_FILE}, or the token itself in "
        f"{ENV_SERVICE_TOKEN}); required with tokens unless mutual TLS",
    )
    group.add_argument(
        "--service-identity",
        help="under mutual TLS, the URI subject alternative name the services' certificates carry, or a "
        f'prefix ending in "/" (env {ENV_SERVICE_IDENTITY}; default {DEFAULT_SERVICE_IDENTITY})',
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
    service_token = read_service_token(None, args.service_token_file)
    ServiceCredential(service_token)  # refuses a short one
    return Security(
        tls,
        verifier,
        args.insecure,
        service_token=service_token,
        service_identity=args.service_identity
        or os.environ.get(ENV_SERVICE_IDENTITY)
        or DEFAULT_SERVICE_IDENTITY,
    )
