"""One call with what happens meanwhile: the events of a RunTool stream, without the transport."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Container, Sequence
from dataclasses import dataclass

from toolmesh.core.calls import ToolCall
from toolmesh.core.progress import ToolProgress
from toolmesh.invocation.invoker import Invoker, InvokeResult
from toolmesh.store.ledger import Delivered


@dataclass(frozen=True, slots=True)
class Started:
    """The call runs or joined this invocation."""

    tool_request_id: str
    # The call's attachment to it, for its delivery confirmation.
    attachment_id: str
    # Until when an exact retry surely joins or replays it (unix seconds).
    retry_safe_until: float


RunEvent = Started | ToolProgress | InvokeResult


async def run_events(
    invoker: Invoker,
    call: ToolCall,
    idempotency_key: str,
    confirmed: Sequence[Delivered],
    sessions: Container[str] | None,
) -> AsyncGenerator[RunEvent, None]:
    """Started (when the call waits on an invocation), its progress reports, then the InvokeResult.

    Raises what `Invoker.invoke` raises. A reader that stops early leaves the
    invocation running, as a unary caller that gives up does. Progress arrives
    at most ten reports a second (the bridge coalesces it), so the queue stays short.
    """
    # The call's end is queued too (None), behind every event it sent: one wait per event.
    events: asyncio.Queue[Started | ToolProgress | None] = asyncio.Queue()

    async def started(tool_request_id: str, attachment_id: str, safe_until: float) -> None:
        events.put_nowait(Started(tool_request_id, attachment_id, safe_until))

    calling = asyncio.ensure_future(
        invoker.invoke(
            call,
            idempotency_key,
            confirmed,
            on_invocation=started,
            sessions=sessions,
            on_progress=events.put_nowait,
        )
    )
    calling.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while (event := await events.get()) is not None:
            yield event
        yield calling.result()
    finally:
        if not calling.done():
            calling.cancel()
