"""What a handler is told about the call it serves."""

from __future__ import annotations

import asyncio
import threading
import time
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
        return self.reason is not None

    async def wait(self) -> None:
        if self.reason is not None:
            return
        if self._async_event is None:
            self._async_event = asyncio.Event()
        await self._async_event.wait()

    def wait_blocking(self, timeout: float | None = None) -> bool:
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
        """Called on the event loop by the SDK."""
        if self.reason is None:
            self.reason = reason
            if self._event is not None:
                self._event.set()
            if self._async_event is not None:
                self._async_event.set()


@dataclass(frozen=True)
class ToolContext:
    session_id: str
    turn_id: str
    tool_request_id: str
    tool_name: str
    # time.monotonic() value when the runtime stops waiting for the result.
    deadline: float
    cancellation: Cancellation = field(default_factory=Cancellation)

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    @property
    def cancelled(self) -> bool:
        return self.cancellation.is_set()
