"""One turn: offer the tools, ask the model, run the tool calls it asks for, until it answers.

A failed tool call becomes a failed ToolResult the model reads in the same
turn. The turn ends with an AssistantError when the code of a failure ends
turns (`ends_turn` in the turn-code table), or when the model, the registry or the
channel fail.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from toolmesh.assistant.channel import ToolChannel
from toolmesh.assistant.config import TOOL_GRACE_S, TurnLimits
from toolmesh.assistant.confirmation import Confirm, ConfirmationRequest, confirm_call
from toolmesh.assistant.errors import TURN_TABLE, AssistantError, TurnCode
from toolmesh.assistant.mapping import describe_violations, tool_result
from toolmesh.assistant.messages import Message, ToolCallRequest
from toolmesh.assistant.model import ChatModel
from toolmesh.assistant.offer import offer
from toolmesh.assistant.results import ToolResult
from toolmesh.core import jsontext
from toolmesh.core.schemas import compile_schema, violations
from toolmesh.core.tools import ToolSet, ToolSpec

log = logging.getLogger("toolmesh.assistant")


@dataclass(frozen=True, slots=True)
class TurnDeps:
    """What every turn of one assistant uses."""

    session_id: str
    channel: ToolChannel
    model: ChatModel
    confirm: Confirm | None
    limits: TurnLimits


class Turn:
    """One turn, run once.

    Args:
        deps: The assistant's channel, model, confirmation callback and limits.
        turn_id: The id every tool call of the turn carries.
        history: Reads the conversation so far.
        record: Adds a message to the conversation.
    """

    def __init__(
        self,
        deps: TurnDeps,
        turn_id: str,
        history: Callable[[], tuple[Message, ...]],
        record: Callable[[Message], None],
    ) -> None:
        self._deps = deps
        self._turn_id = turn_id
        self._history = history
        self._record = record

    async def run(self) -> str:
        """The model's answer; raises AssistantError when the turn ends without one."""
        deps = self._deps
        await deps.channel.check()
        for round_number in itertools.count(1):
            planned = await deps.channel.list_tools()
            reply = await deps.model.complete(self._history(), offer(planned))
            self._record(Message.assistant(reply.text, reply.tool_calls))
            if not reply.tool_calls:
                return reply.text
            if round_number > deps.limits.max_rounds:
                raise AssistantError(
                    TurnCode.TURN_LIMIT,
                    f"The model asked for tools in more than {deps.limits.max_rounds} rounds.",
                )
            for call in reply.tool_calls:
                result = await self._call_tool(call, planned)
                self._record(Message.tool(call, result))
                if result.code is not None and TURN_TABLE[result.code].ends_turn:
                    raise AssistantError(result.code, f"{call.name}: {result.cause}.", {"tool": call.name})
        raise AssertionError("unreachable")

    async def _call_tool(self, call: ToolCallRequest, planned: ToolSet) -> ToolResult:
        tool = planned.find(call.name)
        if tool is None:
            return ToolResult.failure(
                TurnCode.TOOL_UNAVAILABLE,
                f"No tool is named {call.name!r} in this session.",
                cause="not_listed",
            )
        try:
            arguments = jsontext.parse(call.arguments_json)
        except jsontext.NotPlainJson:
            return ToolResult.failure(
                TurnCode.INVALID_ARGUMENTS, "The arguments are not JSON.", cause="not_json"
            )
        if not isinstance(arguments, dict):
            return ToolResult.failure(
                TurnCode.INVALID_ARGUMENTS, "The arguments must be a JSON object.", cause="not_object"
            )
        if tool.annotations.requires_confirmation:
            refused = await self._confirm(tool, arguments, planned.revision)
            if refused is not None:
                return refused
        current = await self._deps.channel.list_tools()
        if current.revision != planned.revision:
            return _stale(planned.revision, current.revision)
        timeout = tool.effective_timeout_ms / 1000 + TOOL_GRACE_S
        if self._deps.limits.tool_timeout_s is not None:
            timeout = min(timeout, self._deps.limits.tool_timeout_s)
        outcome = await self._deps.channel.invoke(
            tool.name, call.arguments_json, turn_id=self._turn_id, timeout=timeout
        )
        result = tool_result(outcome)
        log.info(
            "tool call",
            extra={
                "session_id": self._deps.session_id,
                "turn_id": self._turn_id,
                "tool": tool.name,
                "tool_request_id": outcome.tool_request_id,
                "code": result.code.value if result.code else "OK",
            },
        )
        return result

    async def _confirm(
        self, tool: ToolSpec, arguments: dict[str, object], revision: int
    ) -> ToolResult | None:
        # Nobody is asked to confirm a call that cannot run.
        validator = compile_schema(
            tool.input_schema_json, tool=tool.name, which="inputSchema", require_object=True
        )
        found = violations(validator, arguments)
        if found:
            detail = describe_violations((v.path, v.message) for v in found)
            return ToolResult.failure(TurnCode.INVALID_ARGUMENTS, detail, cause="schema")
        request = ConfirmationRequest(self._deps.session_id, self._turn_id, tool, arguments)
        refused = await confirm_call(self._deps.confirm, request, self._deps.channel, revision)
        if refused is TurnCode.STALE_TOOLS:
            return _stale(revision, None)
        if refused is not None:
            return ToolResult.failure(refused, "The person did not confirm the call.", cause="not_confirmed")
        return None


def _stale(planned: int, current: int | None) -> ToolResult:
    now = f" to {current}" if current is not None else ""
    return ToolResult.failure(
        TurnCode.STALE_TOOLS,
        f"The tool list moved from revision {planned}{now} after the call was planned; it was not run.",
        cause="revision_moved",
    )
