"""This replica's routes: it names itself in the shared store for every session it holds a host of.

Written for every host that opens, refreshed every `refresh_s` and left to
expire after `ttl_s` (toolmesh.contracts.routes). When the last host of a
session leaves, the replica removes the route if it still names it (one
conditional delete: Store.delete_if_value).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from toolmesh.bridge.router import HostSession, Router
from toolmesh.contracts.routes import REFRESH_S, ROUTE_TTL_S, route_key
from toolmesh.core.errors import ToolmeshError
from toolmesh.store.base import Store

log = logging.getLogger("toolmesh.bridge")


class Routes:
    """Publishes this replica's `address` for every session `router` holds a host of."""

    def __init__(
        self,
        store: Store,
        address: str,
        router: Router,
        *,
        ttl_s: float = ROUTE_TTL_S,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self._store = store
        self.address = address
        self._value = address.encode()
        self._router = router
        self._ttl_s = ttl_s
        self._refresh_s = refresh_s
        self._sessions: set[str] = set()
        # Writes in flight, kept so that they are not collected before they run.
        self._writes: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        router.opened_hooks.append(self._opened)
        router.closed_hooks.append(self._closed)

    def start(self) -> None:
        self._refresher = asyncio.create_task(self._refresh())

    def _opened(self, host: HostSession) -> None:
        # Written for every host that opens, not only the first: a host that comes here because
        # its replica died makes the route name this one at once, not at the next refresh.
        self._sessions.add(host.session_id)
        self._spawn(self._write(host.session_id))

    def _closed(self, host: HostSession) -> None:
        if host.session_id in self._sessions and not self._router.serves(host.session_id):
            self._sessions.discard(host.session_id)
            self._spawn(self._remove(host.session_id))

    def _spawn(self, step: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(step)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, session_id: str) -> None:
        try:
            await self._store.put(route_key(session_id), self._value, ttl_s=self._ttl_s)
        except ToolmeshError as error:
            # The next refresh writes it again.
            log.warning("route not written", extra={"session_id": session_id, "code": error.code.value})

    async def _remove(self, session_id: str) -> None:
        try:
            if session_id in self._sessions:  # a host of it came back meanwhile
                return
            # Only our own, in one step: another replica may hold a host of the session too, and
            # have written it (between a read and a delete, its route would be lost).
            await self._store.delete_if_value(route_key(session_id), self._value)
        except ToolmeshError as error:
            log.warning("route not removed", extra={"session_id": session_id, "code": error.code.value})

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await asyncio.gather(*(self._write(session_id) for session_id in list(self._sessions)))

    async def aclose(self) -> None:
        """Stop refreshing and remove this replica's routes (its hosts have gone by now)."""
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        sessions, self._sessions = list(self._sessions), set()
        await asyncio.gather(*(self._remove(session_id) for session_id in sessions))
        if self._writes:
            await asyncio.wait(set(self._writes))
