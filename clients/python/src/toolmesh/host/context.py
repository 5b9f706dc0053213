"""What a handler is told about the call it serves."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# Guards making a Cancellation's thread event; taken only by handlers that wait on one.
_MAKING_EVENTS = threading.Lock()


class Cancellation:
    """Set when the runtime tells the host to stop a call (its deadline passed, or it was cancelled).

    Usable from async handlers (`await wait()`) and from sync handlers running
    in a worker thread (`is_set()`, `wait_blocking()`).
    """

    def __init__(self) -> None:
        # Both made on first use: most calls are never waited on.
        self._event: threading.Event | None = None
        self._async_event: asyncio.Event | None = None
        self.reason: str | None = None

    def is_set(self) -> bool:
        """Whether the runtime said stop; safe to ask from a handler's worker thread."""
        return self.reason is not None

    async def wait(self) -> None:
        """Wait until the runtime says stop (returns at once if it has). For async handlers."""
        if self.reason is not None:
            return
        if self._async_event is None:
            self._async_event = asyncio.Event()
        await self._async_event.wait()

    def wait_blocking(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the runtime says stop, or `timeout` seconds pass.

        For sync handlers, which run in a worker thread; never call it on the
        event loop. Returns True when stopped, False when the timeout passed first.
        """
        event = self._event
        if event is None:
            with _MAKING_EVENTS:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
            # set() may have run before the event existed: it wrote `reason` first.
            if self.reason is not None:
                event.set()
        return event.wait(timeout)

    def set(self, reason: str) -> None:
        """Record why the call stops ("timeout" or "cancelled") and wake every waiter; the first reason stays.

        Called on the event loop by the SDK, not by handlers.
        """
        if self.reason is None:
            self.reason = reason
            if self._event is not None:
                self._event.set()
            if self._async_event is not None:
                self._async_event.set()


# Sends one progress report (progress, total, message) for the call; never raises.
ProgressReporter = Callable[[float, float | None, str | None], Awaitable[None]]


async def _report_nowhere(progress: float, total: float | None, message: str | None) -> None:
    return None


@dataclass(frozen=True)
class ToolContext:
    """What a handler is told about the call it serves: ids, deadline and cancellation.

    The ids are for the handler's own logs and correlation; `deadline` is a
    `time.monotonic()` value, past which the runtime no longer waits for the result.
    """

    session_id: str
    turn_id: str
    tool_request_id: str
    tool_name: str
    # time.monotonic() value when the runtime stops waiting for the result.
    deadline: float
    cancellation: Cancellation = field(default_factory=Cancellation)
    # Set by the host SDK: where report_progress sends reports (nowhere outside a host).
    reporter: ProgressReporter = field(default=_report_nowhere, repr=False, compare=False)

    def time_remaining(self) -> float:
        """Seconds left before the deadline, never negative: a budget for the handler's own calls."""
        return max(0.0, self.deadline - time.monotonic())

    @property
    def cancelled(self) -> bool:
        """Whether the runtime said stop: the deadline passed or the call was cancelled."""
        return self.cancellation.is_set()

    def report_progress(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> Awaitable[None]:
        """Tell the call's callers how far the handler has got; await it (from async handlers).

        `progress` on the handler's own scale, growing from one report to the
        next; `total` the value it reaches when done, when known; `message` for
        people, cut to 512 characters: never put arguments or results in it.
        Best effort: it never raises (a report the bridge drops, or a transport
        failure, is logged without its values and forgotten), never changes the
        outcome and never extends the deadline. The bridge forwards at most ten
        reports a second per call, the latest ones. An async handler awaits it;
        a sync handler (in its worker thread) calls it without await: the
        report is sent from the host's event loop.
        """
        return self.reporter(progress, total, message)
