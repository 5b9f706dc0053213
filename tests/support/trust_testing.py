"""Helpers for tests of who may do what: real certificates (trustme) and tokens signed with a secret."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jwt
import trustme
from cryptography.hazmat.primitives.asymmetric import rsa

from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import SharedSecret, Verifier, mint
from toolmesh.core.tls import TlsFiles
from toolmesh.runtime.security import Security

SECRET = b"a test secret that is long enough for HS256"


@dataclass(frozen=True)
class Pki:
    """A CA and PEM files issued by it: one certificate for the services, one for a client."""

    ca: trustme.CA
    directory: Path

    @classmethod
    def make(cls, directory: Path) -> Pki:
        pki = cls(trustme.CA(), directory)
        directory.mkdir(parents=True, exist_ok=True)
        pki.ca.cert_pem.write_to_path(str(pki.ca_file))
        pki.issue("server", "localhost", "127.0.0.1")
        pki.issue("client", "client.toolmesh.test")
        return pki

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    def issue(self, name: str, *identities: str) -> TlsFiles:
        leaf = self.ca.issue_cert(*identities)
        cert, key = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        leaf.private_key_pem.write_to_path(str(key))
        cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        return TlsFiles(cert, key, self.ca_file)

    def files(self, name: str) -> TlsFiles:
        return TlsFiles(self.directory / f"{name}.pem", self.directory / f"{name}.key", self.ca_file)

    def server_security(self) -> Security:
        """TLS with the server certificate (mutual on internal listeners), tokens from SECRET."""
        return Security(self.files("server"), Verifier(SharedSecret(SECRET)))

    def client_credentials(self, with_certificate: bool = False) -> grpc.ChannelCredentials:
        files = self.files("client") if with_certificate else TlsFiles(ca=self.ca_file)
        return files.channel_credentials()


def token(role: Role | str, *sessions: str, ttl_s: float = 600, secret: bytes = SECRET) -> str:
    return mint(secret, roles=[Role(role)], sessions=sessions, ttl_s=ttl_s, subject="test")


def rsa_jwk(kid: str) -> tuple[Any, dict[str, Any]]:
    """A new RSA private key, and its public key as a JWK (RS256) named `kid`."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    return private, public | {"kid": kid, "alg": "RS256", "use": "sig"}
