"""Cancellations that must reach the replica running an invocation, whichever replica took them.

Replicas share nothing but the store, so a cancellation is posted there: one
key, every replica watches it, and the one that runs the invocation stops it.
Bridge replicas watch it too: the one holding the request stops it at its host
when the invocation replica that sent it died (toolmesh.bridge.cancels).
The key holds the ids of the last KEEP cancellations (JSON), each added with
a conditional write so none is lost to a concurrent one; a watcher that
misses intermediate versions still finds every id in the latest one. A
replica that starts watching ignores what was posted before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.store.base import Store, VersionConflict

log = logging.getLogger("toolmesh.cancels")

CANCELS_KEY = "invocation:cancels"
# The same, for outcomes a bridge replica recorded for a request another replica sent (a host
# that moved off a frozen or lost bridge): the invocation replica waiting on that request reads
# the ledger then, instead of waiting for a bridge that may never answer.
RECORDED_KEY = "invocation:recorded-elsewhere"
# Enough for every cancellation of a burst to be seen by a watcher that reads only the last version.
KEEP = 256
# The key goes away when nobody cancels anything for this long.
KEEP_S = 3600.0
POST_ATTEMPTS = 20


class CancelBoard:
    """Posts cancellations to the store, and follows those posted by every replica.

    `key`: the board's key in the store (CANCELS_KEY; RECORDED_KEY for outcomes recorded elsewhere).
    """

    def __init__(self, store: Store, key: str = CANCELS_KEY) -> None:
        self._store = store
        self._key = key

    async def post(self, tool_request_id: str) -> None:
        """Add the id for every replica to see. Raises ToolmeshError(STORE_UNAVAILABLE) as the store does."""
        for _ in range(POST_ATTEMPTS):
            current = await self._store.get(self._key)
            ids = [] if current is None else _ids(current.value)
            ids = [*ids[-(KEEP - 1) :], tool_request_id]
            try:
                await self._store.put(
                    self._key,
                    json.dumps(ids).encode(),
                    expected_version=0 if current is None else current.version,
                    ttl_s=KEEP_S,
                )
            except VersionConflict:
                continue  # another replica posted meanwhile: add to its list
            return
        raise ToolmeshError(Code.STORE_UNAVAILABLE, "Too many concurrent cancellations.")

    async def follow(self, cancelled: Callable[[str], object], ready: asyncio.Event | None = None) -> None:
        """Call `cancelled` with each id posted from now on, until cancelled; `ready` is set once
        it follows (posts after that are heard)."""
        seen: set[str] | None = None
        async with contextlib.aclosing(self._store.watch(self._key)) as versions:
            async for current in versions:
                ids = [] if current is None else _ids(current.value)
                if seen is not None:
                    for tool_request_id in ids:
                        if tool_request_id not in seen:
                            cancelled(tool_request_id)
                seen = set(ids)
                if ready is not None:
                    ready.set()


def _ids(raw: bytes) -> list[str]:
    try:
        ids = json.loads(raw)
    except ValueError:
        log.error("the store's list of cancellations is not JSON: started over")
        return []
    return [item for item in ids if isinstance(item, str)] if isinstance(ids, list) else []
