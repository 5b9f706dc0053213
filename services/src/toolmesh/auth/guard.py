"""Applying the policy to each call as it arrives (used by toolmesh.runtime.instrument).

An admission is made once per RPC method and listener; per call it reads the
bearer token from the metadata, verifies it (verified tokens are cached) and
checks the method's rule. The caller's grant is then the current one for the
rest of the call, so that servicers can scope by session (`scope`).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Awaitable, Callable, Container, Iterable
from contextvars import ContextVar
from typing import Any

from toolmesh.auth.grants import Grant, Role
from toolmesh.auth.policy import INTERNAL, PUBLIC
from toolmesh.auth.service import ServiceCredential
from toolmesh.auth.tokens import Verifier, client_address, refused
from toolmesh.core.bearer import bearer_token_of
from toolmesh.core.errors import Code, ToolmeshError

Admit = Callable[[Any, Any], Awaitable[None]]

_GRANT: ContextVar[Grant | None] = ContextVar("toolmesh_grant", default=None)


class Listener(enum.Enum):
    PUBLIC = "public"
    INTERNAL = "internal"


def scope(role: Role) -> Container[str] | None:
    """The sessions the current caller may act on in `role`, or None for all of them (no
    authentication configured, or a toolmesh service on the internal listener)."""
    grant = _GRANT.get()
    return None if grant is None else grant.scope(role)


def caller() -> str | None:
    """The current caller's token subject, or None when no token was verified (no authentication)."""
    grant = _GRANT.get()
    return None if grant is None else grant.subject


def grant_expires_at() -> float | None:
    """When the current caller's token expires (epoch seconds, with leeway); None without one."""
    grant = _GRANT.get()
    return None if grant is None else grant.expires_at


def token_expired() -> ToolmeshError:
    """What a stream ends with when the token it was opened with expires (the caller opens a new one)."""
    return refused("expired", "The token this stream was opened with expired: open it again.")


def serves(full_method: str, listener: Listener) -> bool:
    return full_method in (PUBLIC if listener is Listener.PUBLIC else INTERNAL)


def admission(
    full_method: str,
    listener: Listener,
    verifier: Verifier | None,
    service: ServiceCredential | None = None,
    peer_uris: Callable[[Any], Iterable[str]] | None = None,
) -> Admit | None:
    """What a call to `full_method` on `listener` must pass; None when nothing is checked.

    On the internal listener, the `service` credential (its token, and the identity that
    `peer_uris(context)`, the URIs of the peer's certificate, must include); tenants' tokens
    count for nothing there.
    """
    if not serves(full_method, listener):
        return _wrong_listener(full_method, listener)
    if listener is Listener.INTERNAL:
        if service is None or not service.required:
            return None
        return _service_only(full_method, service, peer_uris)
    if verifier is None:
        return None
    rule = PUBLIC[full_method]
    session_of = operator.attrgetter(rule.session_field) if rule.session_field else None
    roles = rule.roles

    async def admit(request: Any, context: Any) -> None:
        peer = context.peer() if hasattr(context, "peer") else ""
        grant = await verifier.grant(bearer_token(context.invocation_metadata()), client_address(peer or ""))
        if roles.isdisjoint(grant.roles):
            raise ToolmeshError(
                Code.PERMISSION_DENIED,
                f"It needs the role {' or '.join(sorted(roles))}.",
                {"rpc": full_method, "roles": ",".join(sorted(roles))},
            )
        if session_of is not None:
            session_id = session_of(request)
            if session_id not in grant.sessions:
                raise ToolmeshError(
                    Code.PERMISSION_DENIED,
                    "Its sessions do not include this one.",
                    {"rpc": full_method, "sessionId": session_id},
                )
        _GRANT.set(grant)

    return admit


def bearer_token(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            token = bearer_token_of(value) if isinstance(value, str) else None
            if token is not None:
                return token
            raise refused("malformed", "The authorization header must be `Bearer <token>`.")
    raise refused("missing", "Send `authorization: Bearer <token>` metadata.")


def _service_only(
    full_method: str, service: ServiceCredential, peer_uris: Callable[[Any], Iterable[str]] | None
) -> Admit:
    def uris_of(context: Any) -> Callable[[], Iterable[str]]:
        return lambda: () if peer_uris is None else peer_uris(context)

    async def admit(request: Any, context: Any) -> None:
        service.check(full_method, context.invocation_metadata(), uris_of(context))

    return admit


def _wrong_listener(full_method: str, listener: Listener) -> Admit:
    async def refuse(request: Any, context: Any) -> None:
        raise ToolmeshError(Code.WRONG_LISTENER, "", {"rpc": full_method, "listener": listener.value})

    return refuse
