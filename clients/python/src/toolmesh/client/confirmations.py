"""Delivery confirmations that ride on the next call, or go alone after a short pause."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import NamedTuple

# A confirmation goes out as soon as the event loop is free, unless a call
# made before then carries it (busy callers batch them onto their calls).
CONFIRM_DELAY_S = 0.0
MAX_PER_CALL = 1000
# Invocations whose calls ended with no outcome, remembered for their retries' confirmations.
MAX_UNANSWERED = 1000


class Delivery(NamedTuple):
    """One confirmation: the caller has the invocation's outcome, for this attachment.

    An empty `attachment_id` is the form for a service that gave none: it
    confirms every caller's attachment to the invocation at once.
    """

    tool_request_id: str
    attachment_id: str = ""


Sender = Callable[[list[Delivery]], Awaitable[bool]]


class PendingConfirmations:
    """Deliveries whose outcome arrived but which are not yet confirmed.

    Until confirmed, an outcome stays replayable for an exact retry; so a
    confirmation that is late costs little, and one that is lost (the process
    died) is harmless: the replay window ends it.

    Each call attached to an invocation has its own attachment, and the
    service keeps the outcome replayable until every attachment is confirmed.
    So a call that ended with no outcome but learnt its attachment (`unanswered`)
    is confirmed with its retry's, once that retry gets the outcome.

    Args:
        send: Sends a batch to the service; returns False when it could not.
        delay_s: How long a confirmation waits for a call to carry it before it is sent alone.
    """

    def __init__(self, send: Sender, delay_s: float = CONFIRM_DELAY_S) -> None:
        self._send = send
        self._delay_s = delay_s
        self._deliveries: list[Delivery] = []
        # tool request id -> attachments of this client's calls that ended with no outcome.
        self._unanswered: dict[str, list[str]] = {}
        self._timer: asyncio.Task[None] | None = None
        self._check: asyncio.Handle | None = None

    def unanswered(self, tool_request_id: str, attachment_id: str) -> None:
        """A call attached to this invocation ended with no outcome: remember its attachment.

        It is confirmed when a retry gets the outcome (`add`). The oldest are
        forgotten beyond MAX_UNANSWERED ids: the replay window then ends what they hold.
        """
        attachments = self._unanswered.setdefault(tool_request_id, [])
        if attachment_id not in attachments:
            attachments.append(attachment_id)
        while len(self._unanswered) > MAX_UNANSWERED:
            del self._unanswered[next(iter(self._unanswered))]

    def add(self, tool_request_id: str, attachment_id: str = "") -> None:
        """Queue the confirmation of one outcome's delivery (and of `unanswered` calls to it).

        Those are the attachments of this client's earlier calls to that
        invocation that got no outcome. The next call carries them, or they go
        alone after `delay_s`.
        """
        earlier = self._unanswered.pop(tool_request_id, [])
        self._deliveries.append(Delivery(tool_request_id, attachment_id))
        if attachment_id:
            self._deliveries.extend(Delivery(tool_request_id, other) for other in earlier)
        self._schedule()

    def _schedule(self) -> None:
        # A plain callback first: usually the caller's next call has taken the
        # deliveries by the time it runs, and no task is needed at all.
        if self._check is None:
            loop = asyncio.get_running_loop()
            self._check = (
                loop.call_soon(self._start_flush)  # a timer costs several times more, on every call
                if self._delay_s <= 0
                else loop.call_later(self._delay_s, self._start_flush)
            )

    def _start_flush(self) -> None:
        self._check = None
        if self._deliveries and (self._timer is None or self._timer.done()):
            self._timer = asyncio.create_task(self.flush())

    def take(self) -> list[Delivery]:
        """The confirmations for the next call to carry (at most MAX_PER_CALL)."""
        taken, self._deliveries = self._deliveries[:MAX_PER_CALL], self._deliveries[MAX_PER_CALL:]
        return taken

    def give_back(self, deliveries: list[Delivery]) -> None:
        """The call that carried these failed before the service saw them, maybe: send them again."""
        if deliveries:
            self._deliveries[:0] = deliveries
            self._schedule()

    async def flush(self) -> None:
        """Send every pending confirmation now, in batches; stop quietly at the first that cannot go."""
        while self._deliveries:
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
