"""Asking a person before a tool that needs confirmation runs.

The prompt is withdrawn (and the call refused with STALE_TOOLS) as soon as the
session's tools move to another revision: the person would be confirming a
plan made on a list that no longer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from toolmesh.assistant.channel import ToolChannel
from toolmesh.assistant.errors import TurnCode
from toolmesh.core.jsontext import JsonValue
from toolmesh.core.tools import ToolSpec

log = logging.getLogger("toolmesh.assistant")


@dataclass(frozen=True, slots=True)
class ConfirmationRequest:
    """What a person is asked to confirm: the tool and the arguments the model gave it."""

    session_id: str
    turn_id: str
    tool: ToolSpec
    arguments: JsonValue


# True runs the tool; False, an exception or a cancelled prompt refuses it.
Confirm = Callable[[ConfirmationRequest], Awaitable[bool] | bool]


async def _ask(confirm: Confirm, request: ConfirmationRequest) -> bool:
    answer = confirm(request)
    if inspect.isawaitable(answer):
        answer = await answer
    return answer is True


async def confirm_call(
    confirm: Confirm | None, request: ConfirmationRequest, channel: ToolChannel, revision: int
) -> TurnCode | None:
    """None when the person confirmed; else CONFIRMATION_DENIED or STALE_TOOLS."""
    if confirm is None:
        return TurnCode.CONFIRMATION_DENIED
    prompt = asyncio.ensure_future(_ask(confirm, request))
    moved = asyncio.ensure_future(channel.wait_for_change(revision))
    try:
        await asyncio.wait({prompt, moved}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (prompt, moved):
            task.cancel()
        for task in (prompt, moved):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if not prompt.done() or prompt.cancelled():
        return (
            TurnCode.STALE_TOOLS if moved.done() and not moved.cancelled() else TurnCode.CONFIRMATION_DENIED
        )
    if prompt.exception() is not None:
        log.warning(
            "the confirmation callback failed",
            extra={"tool": request.tool.name, "error": type(prompt.exception()).__name__},
        )
        return TurnCode.CONFIRMATION_DENIED
    return None if prompt.result() else TurnCode.CONFIRMATION_DENIED
