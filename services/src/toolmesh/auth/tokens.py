"""Signed, expiring bearer tokens (JWT): verifying them into Grants, and minting them for development.

Claims: `iss`, `aud`, `exp` (required), `nbf` and `iat` (checked when present),
`sub` (required, not empty: the grant key every per-grant share and rate is
counted by, so that tokens without one cannot share a quota), `roles` (a list
of call / host / admin) and `sessions` (a list of exact session ids or
prefixes ending in `*`). Keys: an HS256 shared secret (the embedded default),
or the public keys of a JWKS document, from a file (re-read when it changes)
or a URL (PyJWT's PyJWKClient, which caches it).

Verified tokens are cached; at most every KEYS_RECHECK_S a cache hit has the
key set looked at again (the file's modification time; the URL's document once
PyJWT's 300 s cache has lapsed), and the cached tokens whose key id left it are
dropped, so a key removed from the JWKS stops its tokens within that bound.

Before a token not in the cache is verified (a signature check), its client
address must have failed authentication less than its share: a token bucket of
FAILED_AUTH_BURST failures, refilled FAILED_AUTH_PER_S a second; past it, the
call is refused with AUTH_THROTTLED (RESOURCE_EXHAUSTED, RetryInfo) at the cost
of a dictionary look-up. Cached (valid) tokens are never throttled.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jwt

from toolmesh.auth.grants import Grant, Role, Sessions
from toolmesh.core.errors import Code, ToolmeshError

DEFAULT_ISSUER = "toolmesh"
DEFAULT_AUDIENCE = "toolmesh"

# Where the services and `toolmesh token` read their token settings from.
ENV_SECRET = "TOOLMESH_AUTH_SECRET"
ENV_SECRET_FILE = "TOOLMESH_AUTH_SECRET_FILE"
ENV_JWKS = "TOOLMESH_AUTH_JWKS"
ENV_ISSUER = "TOOLMESH_AUTH_ISSUER"
ENV_AUDIENCE = "TOOLMESH_AUTH_AUDIENCE"
# Clocks of issuers and servers may disagree this much.
LEEWAY_S = 30.0
# HS256 wants a key at least as long as its hash (RFC 7518 3.2).
MIN_SECRET_BYTES = 32
# Longer than any token we issue or expect: refused before any parsing.
MAX_TOKEN_CHARS = 8192
# Verified tokens kept, so that a caller's every call does not pay a signature check.
CACHE_SIZE = 4096
# Failed authentications per client address before AUTH_THROTTLED: a burst, then a rate.
FAILED_AUTH_BURST = 100
FAILED_AUTH_PER_S = 20.0
# Client addresses whose failures are tracked at most (past it, those back to a full bucket are forgotten).
MAX_TRACKED_ADDRESSES = 10_000
# How often a cache hit has the key set looked at again (a key removed stops its cached tokens).
KEYS_RECHECK_S = 5.0
SECRET_ALGORITHMS = ("HS256",)


def refused(reason: str, detail: str = "") -> ToolmeshError:
    return ToolmeshError(Code.UNAUTHENTICATED, detail, {"reason": reason})


class Keys(Protocol):
    async def key_for(self, token: str) -> tuple[Any, tuple[str, ...]]:
        """The key that must have signed `token`, and the algorithms allowed with it."""
        ...

    # A key set may also say its key ids as they are now (reloaded when changed; None when unknown):
    # async def key_ids(self) -> frozenset[str] | None. The verifier drops cached tokens of keys gone.


@dataclass(frozen=True, slots=True)
class SharedSecret:
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the auth secret must be at least {MIN_SECRET_BYTES} bytes")

    async def key_for(self, token: str) -> tuple[Any, tuple[str, ...]]:
        return self.secret, SECRET_ALGORITHMS


class JwksFile:
    """Public keys from a JWKS file, read again when its modification time changes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: float | None = None
        self._keys = self._read()

    def _read(self) -> jwt.PyJWKSet:
        stamp = self._path.stat().st_mtime
        keys = jwt.PyJWKSet.from_json(self._path.read_text())
        self._stamp = stamp
        return keys

    def _reload_if_changed(self) -> None:
        try:
            if self._path.stat().st_mtime != self._stamp:
                self._keys = self._read()
        except (OSError, jwt.PyJWKSetError):
            pass  # mid-rotation or gone: keep the keys read last

    async def key_for(self, token: str) -> tuple[Any, tuple[str, ...]]:
        self._reload_if_changed()
        return _pick(self._keys, token)

    async def key_ids(self) -> frozenset[str] | None:
        self._reload_if_changed()
        return _ids(self._keys)


class JwksUrl:
    """Public keys from a JWKS URL (https), fetched off the event loop and cached by PyJWT.

    `ssl_context`: how to check the URL's server (default: the system's CAs).
    """

    def __init__(self, url: str, timeout_s: float = 5.0, ssl_context: ssl.SSLContext | None = None) -> None:
        self._client = jwt.PyJWKClient(
            url, cache_jwk_set=True, lifespan=300, timeout=timeout_s, ssl_context=ssl_context
        )

    async def key_for(self, token: str) -> tuple[Any, tuple[str, ...]]:
        try:
            key = await asyncio.to_thread(self._client.get_signing_key_from_jwt, token)
        except jwt.PyJWKClientConnectionError:
            raise refused("keys_unavailable", "The signing keys could not be fetched.") from None
        except jwt.PyJWKClientError:
            raise refused("unknown_key") from None
        return key.key, (key.algorithm_name,)

    async def key_ids(self) -> frozenset[str] | None:
        try:
            keys = await asyncio.to_thread(self._client.get_jwk_set)
        except jwt.PyJWKClientError:
            return None  # unreachable for now: keep the tokens verified already
        return _ids(keys)


def _ids(keys: jwt.PyJWKSet) -> frozenset[str]:
    return frozenset(key.key_id for key in keys.keys if key.key_id)


def _pick(keys: jwt.PyJWKSet, token: str) -> tuple[Any, tuple[str, ...]]:
    kid = jwt.get_unverified_header(token).get("kid")
    candidates = [key for key in keys.keys if kid is None or key.key_id == kid]
    if len(candidates) != 1:
        raise refused("unknown_key")
    return candidates[0].key, (candidates[0].algorithm_name,)


class FailedAuthentications:
    """A token bucket of failed authentications per client address, looked at before any signature check."""

    def __init__(
        self,
        burst: int = FAILED_AUTH_BURST,
        per_s: float = FAILED_AUTH_PER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._burst = float(burst)
        self._per_s = per_s
        self._clock = clock
        # address -> (failures still allowed, when that was counted)
        self._buckets: dict[str, tuple[float, float]] = {}

    def _level(self, address: str, now: float) -> float:
        allowed, at = self._buckets.get(address, (self._burst, now))
        return min(self._burst, allowed + (now - at) * self._per_s)

    def check(self, address: str) -> None:
        """Raise AUTH_THROTTLED when `address` has used up its failures for now ("" is never throttled)."""
        if not address or address not in self._buckets:
            return
        level = self._level(address, self._clock())
        if level < 1:
            raise ToolmeshError(Code.AUTH_THROTTLED, retry_delay_s=(1 - level) / self._per_s)

    def failed(self, address: str) -> None:
        if not address:
            return
        now = self._clock()
        if address not in self._buckets and len(self._buckets) >= MAX_TRACKED_ADDRESSES:
            self._buckets = {
                key: value for key, value in self._buckets.items() if self._level(key, now) < self._burst
            }
            if len(self._buckets) >= MAX_TRACKED_ADDRESSES:
                self._buckets.clear()
        self._buckets[address] = (max(0.0, self._level(address, now) - 1), now)


def client_address(peer: str) -> str:
    """The address (no port) of a gRPC peer (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`) or of `host:port`."""
    if peer.startswith("unix:"):
        return "unix"
    for prefix in ("ipv4:", "ipv6:"):
        peer = peer.removeprefix(prefix)
    return peer.rsplit(":", 1)[0].strip("[]") if ":" in peer else peer


class Verifier:
    """Turns a bearer token into a Grant, or raises ToolmeshError(UNAUTHENTICATED) saying why not."""

    def __init__(
        self,
        keys: Keys,
        *,
        issuer: str = DEFAULT_ISSUER,
        audience: str = DEFAULT_AUDIENCE,
        leeway_s: float = LEEWAY_S,
        clock: Callable[[], float] = time.time,
        failures: FailedAuthentications | None = None,
    ) -> None:
        self._keys = keys
        self._failures = failures or FailedAuthentications()
        self._issuer = issuer
        self._audience = audience
        self._leeway_s = leeway_s
        self._clock = clock
        # Each verified token's grant, and the id of the key that signed it (None: no kid).
        self._verified: dict[str, tuple[Grant, str | None]] = {}
        self._keys_checked_at = clock()

    async def grant(self, token: str, address: str = "") -> Grant:
        """The token's grant; `address`: the caller's client address, whose failures are counted."""
        if token in self._verified:
            await self._recheck_keys()
        cached = self._verified.get(token)
        if cached is not None:
            grant, _ = cached
            if grant.expires_at > self._clock():
                return grant
            del self._verified[token]
            raise refused("expired")
        self._failures.check(address)
        try:
            return await self._verify(token)
        except ToolmeshError:
            self._failures.failed(address)
            raise

    async def _verify(self, token: str) -> Grant:
        if len(token) > MAX_TOKEN_CHARS:
            raise refused("malformed", "The token is too long.")
        try:
            key, algorithms = await self._keys.key_for(token)
            claims = jwt.decode(
                token,
                key,
                algorithms=list(algorithms),
                audience=self._audience,
                issuer=self._issuer,
                leeway=self._leeway_s,
                options={"require": ["exp", "iss", "aud"]},
            )
        except ToolmeshError:
            raise
        except jwt.ExpiredSignatureError:
            raise refused("expired") from None
        except jwt.ImmatureSignatureError:
            raise refused("not_yet_valid") from None
        except (jwt.InvalidIssuerError, jwt.InvalidAudienceError):
            raise refused("wrong_issuer_or_audience") from None
        except jwt.InvalidSignatureError:
            raise refused("bad_signature") from None
        except (jwt.PyJWTError, ValueError, TypeError):
            raise refused("malformed") from None
        grant = _grant_of(claims, self._leeway_s)
        if len(self._verified) >= CACHE_SIZE:
            self._verified.clear()
        kid = jwt.get_unverified_header(token).get("kid")
        self._verified[token] = (grant, kid if isinstance(kid, str) else None)
        return grant

    async def _recheck_keys(self) -> None:
        """At most every KEYS_RECHECK_S: drop the cached tokens whose key left the key set."""
        key_ids = getattr(self._keys, "key_ids", None)
        now = self._clock()
        if key_ids is None or now - self._keys_checked_at < KEYS_RECHECK_S:
            return
        self._keys_checked_at = now
        current: frozenset[str] | None = await key_ids()
        if current is None:
            return
        # A token without a kid was taken by the only key of the set then: checked again too.
        gone = [token for token, (_, kid) in self._verified.items() if kid is None or kid not in current]
        for token in gone:
            del self._verified[token]


def _grant_of(claims: dict[str, Any], leeway_s: float) -> Grant:
    roles = claims.get("roles")
    sessions = claims.get("sessions")
    subject = claims.get("sub", "")
    if not isinstance(roles, list) or not isinstance(sessions, list) or not isinstance(subject, str):
        raise refused("claims", "The token must carry roles and sessions lists.")
    if not subject.strip():
        # Quotas and shares are counted per subject: tokens without one would all share one.
        raise refused("no_subject", "The token must name its subject (sub): quotas are counted by it.")
    try:
        parsed_roles = frozenset(Role(role) for role in roles)
        parsed_sessions = Sessions.parse(sessions)
    except ValueError:
        raise refused("claims", "The token names an unknown role or a malformed session.") from None
    return Grant(subject, parsed_roles, parsed_sessions, float(claims["exp"]) + leeway_s)


def mint(
    secret: bytes,
    *,
    roles: Iterable[Role],
    sessions: Iterable[str],
    ttl_s: float,
    subject: str | None = None,
    issuer: str = DEFAULT_ISSUER,
    audience: str = DEFAULT_AUDIENCE,
    now: float | None = None,
) -> str:
    """An HS256 token for development and the embedded default. Raises ValueError for a bad session.

    `subject`: its `sub`; None or empty: a new one (`new_subject`), so that no two tokens minted
    without one share a quota.
    """
    session_list = list(sessions)
    Sessions.parse(session_list)
    SharedSecret(secret)
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": issuer,
        "aud": audience,
        "sub": subject or new_subject(),
        "iat": issued,
        "nbf": issued,
        "exp": issued + int(ttl_s),
        "roles": sorted(role.value for role in roles),
        "sessions": session_list,
    }
    return jwt.encode(claims, secret, algorithm="HS256")


def new_subject() -> str:
    """A subject of its own for a token minted without one (random: it names nobody)."""
    return f"sub-{secrets.token_hex(8)}"


def read_secret(value: str | None, file: str | None) -> bytes | None:
    """The shared secret: given as text, or the contents of a file (trailing newline dropped)."""
    if value:
        return value.encode()
    if file:
        return Path(file).read_bytes().rstrip(b"\r\n")
    return None


def keys_from(secret: bytes | None, jwks: str | None) -> Keys | None:
    """The configured keys: a shared secret, or a JWKS file path or https URL; None when neither."""
    if secret and jwks:
        raise ValueError("configure either an auth secret or a JWKS, not both")
    if secret:
        return SharedSecret(secret)
    if jwks:
        if jwks.startswith("https://"):
            return JwksUrl(jwks)
        if "://" in jwks:
            raise ValueError("a JWKS URL must use https")
        return JwksFile(Path(os.path.expanduser(jwks)))
    return None
