"""Helpers for tests of who may do what: real certificates (trustme) and tokens signed with a secret."""

from __future__ import annotations

import datetime
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jwt
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import SharedSecret, Verifier, mint
from toolmesh.core.tls import TlsFiles
from toolmesh.runtime.security import Security

SECRET = b"a test secret that is long enough for HS256"
# What the services' certificates name, so that their internal listeners admit each other.
SERVICE_URI = "spiffe://toolmesh/service/test"
SERVICE_TOKEN = "a service token that is long enough to be one"


@dataclass(frozen=True)
class Pki:
    """A CA and PEM files issued by it: one certificate for the services (naming SERVICE_URI, as
    service certificates do), one for a client (a tenant's: no service identity)."""

    ca: trustme.CA
    directory: Path

    @classmethod
    def make(cls, directory: Path) -> Pki:
        pki = cls(trustme.CA(), directory)
        directory.mkdir(parents=True, exist_ok=True)
        pki.ca.cert_pem.write_to_path(str(pki.ca_file))
        pki.issue("server", "localhost", "127.0.0.1", uris=[SERVICE_URI])
        pki.issue("client", "client.toolmesh.test")
        return pki

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    def issue(self, name: str, *identities: str, uris: list[str] | None = None) -> TlsFiles:
        """A certificate for DNS names and IP addresses, and with `uris`, URI SANs (trustme has none)."""
        cert, key = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        if uris is None:
            leaf = self.ca.issue_cert(*identities)
            leaf.private_key_pem.write_to_path(str(key))
            cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        else:
            pem, private = self._issue_with_uris(identities, uris)
            cert.write_bytes(pem)
            key.write_bytes(private)
        return TlsFiles(cert, key, self.ca_file)

    def _issue_with_uris(self, identities: tuple[str, ...], uris: list[str]) -> tuple[bytes, bytes]:
        ca_key = serialization.load_pem_private_key(self.ca.private_key_pem.bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.ca.cert_pem.bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
        for identity in identities:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(identity)))
            except ValueError:
                names.append(x509.DNSName(identity))
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.ORGANIZATIONAL_UNIT_NAME, "toolmesh")]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return certificate.public_bytes(serialization.Encoding.PEM), private

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
