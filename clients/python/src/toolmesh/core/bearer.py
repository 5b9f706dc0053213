"""The token a client sends with every call: `authorization: Bearer <token>` metadata.

A token is fixed text, or a callback (sync or async) asked before each call,
so that a long-lived host or client can refresh it; keep the callback cheap
(cache the token until shortly before it expires).
"""

from __future__ import annotations

import base64
import binascii
import inspect
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence

ENV_TOKEN = "TOOLMESH_TOKEN"
HEADER = "authorization"
# The scheme of the header's value, compared without regard to case (RFC 9110).
SCHEME = "bearer "

TokenSource = str | Callable[[], str | Awaitable[str]]
Metadata = Sequence[tuple[str, str]]


def bearer_token_of(header: str) -> str | None:
    """The token of an `authorization` header's value, None when it is not `Bearer <token>`."""
    if header[: len(SCHEME)].lower() != SCHEME:
        return None
    return header[len(SCHEME) :].strip()


def token_from_env(flag: str | None = None) -> str | None:
    """The `--token` flag, else TOOLMESH_TOKEN, else None."""
    return flag or os.environ.get(ENV_TOKEN) or None


# A long-lived stream is opened again this long before its token expires (or a third of the
# token's remaining life, when that is shorter), so that it never reaches the expiry.
RENEW_AHEAD_S = 30.0


def expires_at(token: str) -> float | None:
    """The `exp` claim of a JWT (epoch seconds), read without verifying it; None when it has none.

    The client only schedules the renewal of its own token's streams with it: the
    services verify the token.
    """
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, binascii.Error):
        return None
    exp = payload.get("exp") if isinstance(payload, dict) else None
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


def renew_in(token: str | None, now: float | None = None) -> float | None:
    """Seconds until a stream opened with `token` should be opened again; None: never (no expiry)."""
    exp = expires_at(token) if token else None
    if exp is None:
        return None
    remaining = exp - (time.time() if now is None else now)
    return max(remaining - min(RENEW_AHEAD_S, remaining / 3), 0.0)


class Bearer:
    """Adds the token to a call's metadata; with no token, the metadata is left as it is."""

    def __init__(self, source: TokenSource | None) -> None:
        self._source = source
        self._fixed = (HEADER, f"Bearer {source}") if isinstance(source, str) else None

    async def token(self) -> str | None:
        """The token to send now (the callback's current one), or None."""
        source = self._source
        if source is None or isinstance(source, str):
            return source
        token = source()
        if inspect.isawaitable(token):
            token = await token
        return token

    async def metadata(self, metadata: Metadata = ()) -> Metadata:
        if self._source is None:
            return metadata
        header = self._fixed
        if header is None:
            header = (HEADER, f"Bearer {await self.token()}")
        return (*metadata, header)

    @staticmethod
    def with_token(token: str | None, metadata: Metadata = ()) -> Metadata:
        """`metadata` with `token` (from `token()`) added, as `metadata()` adds it."""
        return metadata if token is None else (*metadata, (HEADER, f"Bearer {token}"))
