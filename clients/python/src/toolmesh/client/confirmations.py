"""Delivery confirmations that ride on the next call, or go alone after a short pause."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

# A confirmation goes out as soon as the event loop is free, unless a call
# made before then carries it (busy callers batch them onto their calls).
CONFIRM_DELAY_S = 0.0
MAX_PER_CALL = 1000

Sender = Callable[[list[str]], Awaitable[bool]]


class PendingConfirmations:
    """Tool request ids whose outcome arrived but whose delivery is not yet confirmed.

    Until confirmed, an outcome stays replayable for an exact retry; so a
    confirmation that is late costs little, and one that is lost (the process
    died) is harmless: the replay window ends it.

    Args:
        send: Sends a batch of ids to the service; returns False when it could not.
        delay_s: How long an id waits for a call to carry it before it is sent alone.
    """

    def __init__(self, send: Sender, delay_s: float = CONFIRM_DELAY_S) -> None:
        self._send = send
        self._delay_s = delay_s
        self._ids: list[str] = []
        self._timer: asyncio.Task[None] | None = None
        self._check: asyncio.Handle | None = None

    def add(self, tool_request_id: str) -> None:
        """Queue one confirmation: the next call carries it, or it goes alone after `delay_s`."""
        self._ids.append(tool_request_id)
        self._schedule()

    def _schedule(self) -> None:
        # A plain callback first: usually the caller's next call has taken the
        # ids by the time it runs, and no task is needed at all.
        if self._check is None:
            loop = asyncio.get_running_loop()
            self._check = loop.call_later(self._delay_s, self._start_flush)

    def _start_flush(self) -> None:
        self._check = None
        if self._ids and (self._timer is None or self._timer.done()):
            self._timer = asyncio.create_task(self.flush())

    def take(self) -> list[str]:
        """The ids for the next call to carry (at most MAX_PER_CALL)."""
        taken, self._ids = self._ids[:MAX_PER_CALL], self._ids[MAX_PER_CALL:]
        return taken

    def give_back(self, tool_request_ids: list[str]) -> None:
        """The call that carried these failed before the service saw them, maybe: send them again."""
        if tool_request_ids:
            self._ids[:0] = tool_request_ids
            self._schedule()

    async def flush(self) -> None:
        """Send every pending id now, in batches; stop quietly at the first batch that cannot be sent."""
        while self._ids:
            batch = self.take()
            if not await self._send(batch):
                return  # unreachable now; the replay window covers what is left

    async def close(self) -> None:
        """Send what is still pending; a send already under way is let finish, not cut off."""
        if self._check is not None:
            self._check.cancel()
            self._check = None
        if self._timer is not None and self._timer is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        await self.flush()
