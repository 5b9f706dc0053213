"""The conversation as plain values, independent of any model's wire format."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from toolmesh.assistant.results import ToolResult


class Author(enum.StrEnum):
    """Who wrote a message: the person, the model, or a tool's result."""

    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class ToolCallRequest:
    """One tool call the model asked for; the arguments as the model wrote them."""

    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True, slots=True)
class Message:
    """One message of the conversation; make them with `user`, `assistant` and `tool`."""

    role: Author
    text: str = ""
    # The model's tool calls (assistant messages).
    tool_calls: tuple[ToolCallRequest, ...] = ()
    # The call this message answers (tool messages).
    call: ToolCallRequest | None = None
    result: ToolResult | None = None

    @classmethod
    def user(cls, text: str) -> Message:
        """What the person typed."""
        return cls(Author.USER, text)

    @classmethod
    def assistant(cls, text: str, tool_calls: tuple[ToolCallRequest, ...] = ()) -> Message:
        """The model's reply: its text and the tool calls it asked for."""
        return cls(Author.ASSISTANT, text, tool_calls)

    @classmethod
    def tool(cls, call: ToolCallRequest, result: ToolResult) -> Message:
        """The answer to one tool call; its text is what the model reads."""
        return cls(Author.TOOL, result.text, call=call, result=result)


def unanswered_calls(messages: tuple[Message, ...]) -> list[ToolCallRequest]:
    """Tool calls of the last assistant message that no tool message answers yet."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role is Author.ASSISTANT:
            answered = {m.call.id for m in messages[index + 1 :] if m.call is not None}
            return [call for call in message.tool_calls if call.id not in answered]
    return []
