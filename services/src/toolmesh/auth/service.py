"""Telling toolmesh services from everyone else on the internal listeners.

The internal RPCs (policy.INTERNAL) run any session's tools and replace any
session's tool list, so only the services themselves may call them. A caller
proves it is one by either or both of:

- a service token the operator configures (or `toolmesh up` generates per
  process), sent as `x-toolmesh-service-token` metadata and compared in
  constant time;
- with mutual TLS, a client certificate naming a service identity, a URI
  subject alternative name such as `spiffe://toolmesh/service/bridge`, which
  the services' certificates carry and a tenant's certificate from the same CA
  does not.

Every configured credential is required on every internal RPC, streams included.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolmesh.core.errors import Code, ToolmeshError

SERVICE_TOKEN_HEADER = "x-toolmesh-service-token"
ENV_SERVICE_TOKEN = "TOOLMESH_SERVICE_TOKEN"
ENV_SERVICE_TOKEN_FILE = "TOOLMESH_SERVICE_TOKEN_FILE"
ENV_SERVICE_IDENTITY = "TOOLMESH_SERVICE_IDENTITY"
# A value ending in "/" is a prefix: any service under it (registry, invocation, bridge).
DEFAULT_SERVICE_IDENTITY = "spiffe://toolmesh/service/"
# A token shorter than this is guessable by whoever can reach the port.
MIN_SERVICE_TOKEN_CHARS = 32

# The URIs the peer's client certificate names (empty without one); asked only when needed.
PeerUris = Callable[[], Iterable[str]]


@dataclass(frozen=True, slots=True)
class ServiceCredential:
    """What a caller of an internal RPC must show; nothing when neither is set (loopback default)."""

    token: str | None = field(default=None, repr=False)
    # A required URI SAN (or a prefix ending in "/") of the peer's certificate; None: not checked.
    identity: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < MIN_SERVICE_TOKEN_CHARS:
            raise ValueError(f"the service token must be {MIN_SERVICE_TOKEN_CHARS} characters or more")

    @property
    def required(self) -> bool:
        return self.token is not None or self.identity is not None

    @property
    def prefix(self) -> bool:
        return self.identity is not None and self.identity.endswith("/")

    def check(self, full_method: str, metadata: Any, peer_uris: PeerUris) -> None:
        """Raise ToolmeshError (UNAUTHENTICATED, PERMISSION_DENIED) unless the caller is a service."""
        if self.token is not None:
            sent = service_token_of(metadata)
            if sent is None:
                raise ToolmeshError(
                    Code.UNAUTHENTICATED,
                    "Internal RPCs are for toolmesh services: send the service token.",
                    {"rpc": full_method, "reason": "service_token_missing"},
                )
            if not hmac.compare_digest(sent.encode(), self.token.encode()):
                raise ToolmeshError(
                    Code.UNAUTHENTICATED,
                    "Internal RPCs are for toolmesh services: the service token is not this one.",
                    {"rpc": full_method, "reason": "service_token_wrong"},
                )
        if self.identity is not None and not self.names_service(peer_uris()):
            raise ToolmeshError(
                Code.PERMISSION_DENIED,
                "Internal RPCs are for toolmesh services: the client certificate names no service identity.",
                {"rpc": full_method, "reason": "not_a_service"},
            )

    def names_service(self, uris: Iterable[str]) -> bool:
        """Whether one of a certificate's `uris` is the service identity (or under its prefix)."""
        identity = self.identity
        if identity is None:
            return False
        if self.prefix:
            return any(uri.startswith(identity) and len(uri) > len(identity) for uri in uris)
        return identity in uris


def service_token_of(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == SERVICE_TOKEN_HEADER and isinstance(value, str):
            return value
    return None


def read_service_token(value: str | None, file: str | None) -> str | None:
    """The service token: given as text, or the contents of a file (trailing newline dropped)."""
    value = value or os.environ.get(ENV_SERVICE_TOKEN)
    file = file or os.environ.get(ENV_SERVICE_TOKEN_FILE)
    if value:
        return value
    if file:
        return Path(os.path.expanduser(file)).read_text().rstrip("\r\n")
    return None


def generate_service_token() -> str:
    """A random token for services started together in one process (`toolmesh up`)."""
    return secrets.token_urlsafe(32)
