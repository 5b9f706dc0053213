"""What the turn needs from a model: given the conversation and the tools, a reply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from toolmesh.assistant.messages import Message, ToolCallRequest


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A tool as offered to the model: name, description and the JSON Schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ModelReply:
    """A model's reply: text, tool calls, or both."""

    text: str
    tool_calls: tuple[ToolCallRequest, ...] = ()


class ChatModel(Protocol):
    """What a turn needs from a model (implemented by OpenAIChatModel)."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[FunctionTool]) -> ModelReply:
        """The model's next reply. Raises AssistantError with MODEL_ERROR or TIMEOUT."""
        ...

    async def close(self) -> None:
        """Release the model's connections."""
        ...
