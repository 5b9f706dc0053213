"""Progress reports of one pending tool request, on their way to its callers, rate-limited.

A handler may report as often as it likes; its callers get at most one
report per PROGRESS_INTERVAL_MS, the latest of those made meanwhile (never
an older one after a newer one). A chatty handler costs the bridge one
timer per request and its callers nothing more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from toolmesh.core.limits import PROGRESS_INTERVAL_MS
from toolmesh.core.progress import ToolProgress

ProgressSink = Callable[[ToolProgress], None]


class ProgressGate:
    """Passes one request's reports to `sink`: at once when the interval since the last one has
    passed, else the latest of them when it ends. Closed when the request ends: a report still
    waiting then is dropped (its callers have the outcome)."""

    __slots__ = ("_interval_s", "_last", "_queued", "_sink", "_timer")

    def __init__(self, sink: ProgressSink, interval_s: float = PROGRESS_INTERVAL_MS / 1000) -> None:
        self._sink = sink
        self._interval_s = interval_s
        self._last = float("-inf")
        self._queued: ToolProgress | None = None
        self._timer: asyncio.TimerHandle | None = None

    def offer(self, progress: ToolProgress) -> None:
        if self._timer is not None:
            self._queued = progress  # the one waiting is older: replaced
            return
        now = time.monotonic()
        wait = self._last + self._interval_s - now
        if wait <= 0:
            self._last = now
            self._sink(progress)
            return
        self._queued = progress
        self._timer = asyncio.get_running_loop().call_later(wait, self._flush)

    def _flush(self) -> None:
        self._timer = None
        queued, self._queued = self._queued, None
        if queued is not None:
            self._last = time.monotonic()
            self._sink(queued)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queued = None
