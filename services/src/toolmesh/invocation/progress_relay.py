"""Progress of an invocation for the callers that joined it through another invocation replica.

The replica that runs an invocation gets its progress reports from the bridge
and gives them to its own callers. With replicas sharing a store it also
writes the latest report under `invocation:progress:<tool request id>` (on a
Redis Cluster in the session's slot, whose tag the id carries, and announced
there by sharded pub/sub like every write), and a replica whose caller joined
the invocation watches that key and passes each report on. At most one write
per PROGRESS_INTERVAL_MS per invocation, the latest report (as the bridge
forwards them), kept no longer than the invocation's deadline. A watcher that
misses a report sees a later one: progress is best effort, only the latest matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from toolmesh.core.errors import ToolmeshError
from toolmesh.core.limits import PROGRESS_INTERVAL_MS
from toolmesh.core.progress import ToolProgress
from toolmesh.invocation.ports import ProgressSink
from toolmesh.store.base import Store

PROGRESS_PREFIX = "invocation:progress:"
INTERVAL_S = PROGRESS_INTERVAL_MS / 1000


def progress_key(tool_request_id: str) -> str:
    return PROGRESS_PREFIX + tool_request_id


class ProgressRelay:
    """Writes the progress of the invocations this replica runs; follows that of others'."""

    def __init__(self, store: Store, interval_s: float = INTERVAL_S) -> None:
        self._store = store
        self._interval_s = interval_s
        # The latest report not written yet and how long to keep it, by tool request id; and the
        # task writing each invocation's reports (one at a time, in order).
        self._unwritten: dict[str, tuple[ToolProgress, float]] = {}
        self._writers: dict[str, asyncio.Task[None]] = {}

    def publish(self, progress: ToolProgress, keep_s: float) -> None:
        """Write `progress` for other replicas' callers, kept `keep_s`, without waiting: a report
        made while the last one is written, or within the interval after it, replaces the one waiting."""
        tool_request_id = progress.tool_request_id
        self._unwritten[tool_request_id] = (progress, keep_s)
        if tool_request_id not in self._writers:
            self._writers[tool_request_id] = asyncio.create_task(self._write(tool_request_id))

    async def _write(self, tool_request_id: str) -> None:
        try:
            while (unwritten := self._unwritten.pop(tool_request_id, None)) is not None:
                progress, keep_s = unwritten
                written_at = time.monotonic()
                # Best effort: a report the store cannot take now is passed over (a later one follows).
                with contextlib.suppress(ToolmeshError):
                    await self._store.put(progress_key(tool_request_id), _encode(progress), ttl_s=keep_s)
                await asyncio.sleep(max(0.0, written_at + self._interval_s - time.monotonic()))
        finally:
            del self._writers[tool_request_id]

    async def follow(self, tool_request_id: str, sink: ProgressSink) -> None:
        """Give `sink` the invocation's latest report, then each later one; until cancelled."""
        async with contextlib.aclosing(self._store.watch(progress_key(tool_request_id))) as versions:
            async for current in versions:
                progress = None if current is None else _decode(tool_request_id, current.value)
                if progress is not None:
                    sink(progress)

    async def aclose(self) -> None:
        """Stop writing (the process is stopping)."""
        writers = list(self._writers.values())
        for writer in writers:
            writer.cancel()
        if writers:
            await asyncio.wait(writers)


def _encode(progress: ToolProgress) -> bytes:
    return json.dumps([progress.progress, progress.total, progress.message], separators=(",", ":")).encode()


def _decode(tool_request_id: str, raw: bytes) -> ToolProgress | None:
    """The report as written, None when the bytes are not one (nothing to pass on)."""
    try:
        value, total, message = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not isinstance(value, (int, float)) or not isinstance(total, (int, float, type(None))):
        return None
    return ToolProgress(tool_request_id, value, total, message if isinstance(message, str) else None)
