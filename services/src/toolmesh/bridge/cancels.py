"""Cancellations that reach a host although the invocation replica that sent its request died.

A request's cancellation normally travels on the DispatchToolRequests stream it
came on. With a shared ledger a request outlives that stream (its invocation
replica may have died: the host's outcome is recorded all the same), and then
the only way a cancellation taken by another invocation replica reaches it is
the store's board of cancellations (toolmesh.contracts.cancels), which every
bridge replica follows too: the one holding the request stops it as its stream
would have. A request whose stream is still open is stopped the same way; the
stream's own cancellation, coming after, finds it ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from toolmesh.contracts.cancels import CancelBoard

Stop = Callable[[str], None]


class HeldRequests:
    """The requests this replica's dispatch streams hold, by tool request id, and how to stop each."""

    def __init__(self) -> None:
        self._stops: dict[str, Stop] = {}

    def hold(self, tool_request_id: str, stop: Stop) -> None:
        # The first holder keeps it: a duplicate sent on another stream is refused by the router.
        self._stops.setdefault(tool_request_id, stop)

    def release(self, tool_request_id: str, stop: Stop) -> None:
        """No longer held by the holder that `stop` stops (another's hold stays)."""
        if self._stops.get(tool_request_id) == stop:
            del self._stops[tool_request_id]

    def cancelled(self, tool_request_id: str) -> None:
        """An invocation replica cancelled it: stop it here if it is held here."""
        stop = self._stops.get(tool_request_id)
        if stop is not None:
            stop(tool_request_id)

    async def follow(self, board: CancelBoard, ready: asyncio.Event | None = None) -> None:
        """Stop the held requests the board names from now on; until cancelled (`ready` as
        CancelBoard.follow)."""
        await board.follow(self.cancelled, ready)
