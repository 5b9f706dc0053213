"""The token a client sends with every call: `authorization: Bearer <token>` metadata.

A token is fixed text, or a callback (sync or async) asked before each call,
so that a long-lived host or client can refresh it; keep the callback cheap
(cache the token until shortly before it expires).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Awaitable, Callable, Sequence

ENV_TOKEN = "TOOLMESH_TOKEN"
HEADER = "authorization"

TokenSource = str | Callable[[], str | Awaitable[str]]
Metadata = Sequence[tuple[str, str]]


def token_from_env(flag: str | None = None) -> str | None:
    """The `--token` flag, else TOOLMESH_TOKEN, else None."""
    return flag or os.environ.get(ENV_TOKEN) or None


class Bearer:
    """Adds the token to a call's metadata; with no token, the metadata is left as it is."""

    def __init__(self, source: TokenSource | None) -> None:
        self._source = source
        self._fixed = (HEADER, f"Bearer {source}") if isinstance(source, str) else None

    async def metadata(self, metadata: Metadata = ()) -> Metadata:
        source = self._source
        if source is None:
            return metadata
        header = self._fixed
        if header is None:
            assert not isinstance(source, str)
            token = source()
            if inspect.isawaitable(token):
                token = await token
            header = (HEADER, f"Bearer {token}")
        return (*metadata, header)
